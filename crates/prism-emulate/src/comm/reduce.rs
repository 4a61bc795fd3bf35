//! Element-wise reductions on little-endian byte buffers, and the data a rank receives when
//! every member of its group contributed what it did ([`synthesize`]: the recording backend's
//! answer, and the coordinator's rule for virtual contributions).

use super::{DType, Op, ReduceOp, dtype_size};

macro_rules! fold_float {
    ($t:ty, $n:expr, $op:expr, $contribs:expr, $out:expr) => {{
        let k = $contribs.len();
        for (i, o) in $out.chunks_exact_mut($n).enumerate() {
            let get = |c: &[u8]| {
                let mut a = [0u8; $n];
                a.copy_from_slice(&c[i * $n..(i + 1) * $n]);
                <$t>::from_le_bytes(a)
            };
            let mut acc = get($contribs[0]);
            for c in &$contribs[1..] {
                let x = get(c);
                acc = match $op {
                    ReduceOp::Sum | ReduceOp::Avg => acc + x,
                    ReduceOp::Max => {
                        if x > acc {
                            x
                        } else {
                            acc
                        }
                    }
                    ReduceOp::Min => {
                        if x < acc {
                            x
                        } else {
                            acc
                        }
                    }
                    ReduceOp::Product => acc * x,
                };
            }
            if $op == ReduceOp::Avg {
                acc /= k as $t;
            }
            o.copy_from_slice(&acc.to_le_bytes());
        }
    }};
}

macro_rules! fold_int {
    ($t:ty, $n:expr, $op:expr, $contribs:expr, $out:expr) => {{
        let k = $contribs.len();
        for (i, o) in $out.chunks_exact_mut($n).enumerate() {
            let get = |c: &[u8]| {
                let mut a = [0u8; $n];
                a.copy_from_slice(&c[i * $n..(i + 1) * $n]);
                <$t>::from_le_bytes(a)
            };
            let mut acc = get($contribs[0]);
            for c in &$contribs[1..] {
                let x = get(c);
                acc = match $op {
                    ReduceOp::Sum | ReduceOp::Avg => acc.wrapping_add(x),
                    ReduceOp::Max => acc.max(x),
                    ReduceOp::Min => acc.min(x),
                    ReduceOp::Product => acc.wrapping_mul(x),
                };
            }
            if $op == ReduceOp::Avg {
                acc /= k as $t;
            }
            o.copy_from_slice(&acc.to_le_bytes());
        }
    }};
}

/// Reduces `contribs` element-wise into `out`, folding left in the order given (so the result
/// is the same bits wherever it is computed from the same order). Every contribution and `out`
/// must have the same length, a whole number of elements. `f16`, `bf16` and opaque bytes are
/// refused by name.
pub fn reduce(
    dtype: DType,
    op: ReduceOp,
    contribs: &[&[u8]],
    out: &mut [u8],
) -> Result<(), String> {
    let Some(first) = contribs.first() else {
        return Err("a reduction of no contributions".into());
    };
    let n = dtype_size(dtype);
    if contribs.iter().any(|c| c.len() != first.len()) || out.len() != first.len() {
        return Err("contributions of different lengths".into());
    }
    if !out.len().is_multiple_of(n) {
        return Err(format!(
            "{} bytes is not a whole number of {dtype:?}",
            out.len()
        ));
    }
    match dtype {
        DType::F32 => fold_float!(f32, 4, op, contribs, out),
        DType::F64 => fold_float!(f64, 8, op, contribs, out),
        DType::I32 => fold_int!(i32, 4, op, contribs, out),
        DType::I64 => fold_int!(i64, 8, op, contribs, out),
        DType::U8 => fold_int!(u8, 1, op, contribs, out),
        DType::F16 | DType::Bf16 | DType::Bytes => {
            return Err(format!("reduction of {dtype:?} is not supported"));
        }
    }
    Ok(())
}

/// The result for a rank at group index `me` (of `g`) when every member contributed a copy of
/// `input`: an all-reduce reduces `g` copies, a reduce-scatter gives chunk `me` of that, an
/// all-gather repeats `input` `g` times, an all-to-all repeats chunk `me`, a broadcast returns
/// `input`, a receive gets zeros. `out` has the op's output length.
pub fn synthesize(
    op: Op,
    dtype: DType,
    reduce_op: ReduceOp,
    g: usize,
    me: usize,
    input: &[u8],
    out: &mut [u8],
) -> Result<(), String> {
    let g = g.max(1);
    let want = super::output_len(op, input.len(), g, dtype_size(dtype))?;
    let want = if op == Op::Recv { out.len() } else { want };
    if out.len() != want || me >= g {
        return Err(format!(
            "{op:?} of {} bytes at group index {me} of {g}: output of {} bytes, {want} expected",
            input.len(),
            out.len()
        ));
    }
    match op {
        Op::AllReduce => reduce(dtype, reduce_op, &vec![input; g], out),
        Op::ReduceScatter => {
            let c = out.len();
            let chunk = &input[me * c..(me + 1) * c];
            reduce(dtype, reduce_op, &vec![chunk; g], out)
        }
        Op::AllGather => {
            for o in out.chunks_exact_mut(input.len().max(1)) {
                o.copy_from_slice(input);
            }
            Ok(())
        }
        Op::AllToAll => {
            let c = input.len() / g;
            if c > 0 {
                let chunk = &input[me * c..(me + 1) * c];
                for o in out.chunks_exact_mut(c) {
                    o.copy_from_slice(chunk);
                }
            }
            Ok(())
        }
        Op::Broadcast => {
            out.copy_from_slice(input);
            Ok(())
        }
        Op::Recv => {
            out.fill(0);
            Ok(())
        }
        Op::Send | Op::Barrier | Op::Unspecified => Ok(()),
    }
}
