//! An NCCL-ABI shim: a shared library with NCCL's SONAME (`libnccl.so.2`) whose collectives,
//! sends and receives go to the Prism emulation coordinator over protocol v1 (through
//! [`prism_emulate::comm::Communicator`]), for programs that call NCCL directly (`LD_PRELOAD`).
//! See `docs/emulate.md`, "NCCL shim".
//!
//! Scope (stretch goal, partial): **host buffers only**. Calls block until the coordinator's
//! `Done` and read and write the buffers with the CPU, ignoring the stream; device pointers
//! (real CUDA buffers) are not supported, as that needs the CUDA runtime. A communicator over
//! the whole world (`nranks == PRISM_WORLD_SIZE`) maps group rank `i` to global rank `i`; any
//! other needs its global ranks given first with [`prismNcclSetNextGroup`] (NCCL tells a
//! library only the unique id, the size and the rank). Calls inside `ncclGroupStart/End` run at
//! once (sends are eager in the coordinator's model, so a batch of sends and receives cannot
//! deadlock). `ncclReduce` is an all-reduce whose result only the root keeps. `ncclCommSplit` is
//! refused. The session (from `PRISM_RANK`, `PRISM_WORLD_SIZE`, `PRISM_COORDINATOR`) opens on
//! the first communicator and ends with `Bye` when the last one is destroyed.
//!
//! Why `unsafe` is allowed here: the NCCL ABI passes raw pointers (buffers, handles, out
//! parameters) that must be dereferenced; every such access is in this file and relies on the
//! caller's NCCL contract, stated on each function.

#![allow(unsafe_code)]

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ffi::{CString, c_char, c_int, c_void};
use std::sync::Mutex;

use prism_emulate::comm::{Communicator, DType, Op, ReduceOp};

/// `ncclResult_t` values.
pub const NCCL_SUCCESS: c_int = 0;
pub const NCCL_SYSTEM_ERROR: c_int = 2;
pub const NCCL_INTERNAL_ERROR: c_int = 3;
pub const NCCL_INVALID_ARGUMENT: c_int = 4;
pub const NCCL_INVALID_USAGE: c_int = 5;
pub const NCCL_REMOTE_ERROR: c_int = 6;

/// The NCCL version this shim reports (2.28.9, as `ncclGetVersion` encodes it).
pub const NCCL_VERSION_CODE: c_int = 22809;

/// `ncclUniqueId`: 128 opaque bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct NcclUniqueId {
    pub internal: [c_char; 128],
}

/// A communicator (`ncclComm_t` points to one).
#[derive(Debug)]
pub struct Comm {
    nranks: u32,
    rank: u32,
    /// Global rank of each group rank.
    global: Vec<u32>,
}

/// Overrides of the environment, for tests in this process.
type EnvMap = BTreeMap<String, String>;

struct State {
    session: Option<Communicator>,
    comms: usize,
    next_group: Option<Vec<u32>>,
    env: EnvMap,
}

static STATE: Mutex<State> = Mutex::new(State {
    session: None,
    comms: 0,
    next_group: None,
    env: BTreeMap::new(),
});

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn fail(code: c_int, msg: String) -> c_int {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
    code
}

fn state() -> std::sync::MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Sets environment overrides (tests: the variables this process would get from the launcher).
pub fn set_env_override(vars: &[(&str, &str)]) {
    state().env = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
}

fn env_var(st: &State, k: &str) -> Option<String> {
    st.env.get(k).cloned().or_else(|| std::env::var(k).ok())
}

fn dtype(d: c_int) -> Option<(DType, usize)> {
    Some(match d {
        0 => (DType::Bytes, 1), // ncclInt8: no i8 in the protocol (no reduction)
        1 => (DType::U8, 1),
        2 => (DType::I32, 4),
        3 => (DType::Bytes, 4), // ncclUint32
        4 => (DType::I64, 8),
        5 => (DType::Bytes, 8), // ncclUint64
        6 => (DType::F16, 2),
        7 => (DType::F32, 4),
        8 => (DType::F64, 8),
        9 => (DType::Bf16, 2),
        _ => return None,
    })
}

fn reduce_op(op: c_int) -> Option<ReduceOp> {
    Some(match op {
        0 => ReduceOp::Sum,
        1 => ReduceOp::Product,
        2 => ReduceOp::Max,
        3 => ReduceOp::Min,
        4 => ReduceOp::Avg,
        _ => return None,
    })
}

/// `ncclGetVersion`.
///
/// # Safety
/// `version` is null or points to a writable `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGetVersion(version: *mut c_int) -> c_int {
    if version.is_null() {
        return fail(NCCL_INVALID_ARGUMENT, "ncclGetVersion: null pointer".into());
    }
    // SAFETY: non-null and writable by the caller's contract.
    unsafe { *version = NCCL_VERSION_CODE };
    NCCL_SUCCESS
}

/// `ncclGetUniqueId`: a marker id (membership comes from the size or
/// [`prismNcclSetNextGroup`], not from the id).
///
/// # Safety
/// `id` is null or points to a writable `ncclUniqueId`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGetUniqueId(id: *mut NcclUniqueId) -> c_int {
    if id.is_null() {
        return fail(
            NCCL_INVALID_ARGUMENT,
            "ncclGetUniqueId: null pointer".into(),
        );
    }
    let mut v = NcclUniqueId { internal: [0; 128] };
    for (d, s) in v.internal.iter_mut().zip(b"prism-emulate") {
        *d = *s as c_char;
    }
    // SAFETY: non-null and writable by the caller's contract.
    unsafe { *id = v };
    NCCL_SUCCESS
}

/// Sets the global ranks (group-rank order) of the next communicator created whose size
/// matches: what NCCL does not tell a library and a launcher hook knows.
///
/// # Safety
/// `ranks` points to `n` readable `int`s.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn prismNcclSetNextGroup(ranks: *const c_int, n: c_int) -> c_int {
    if ranks.is_null() || n <= 0 {
        return fail(
            NCCL_INVALID_ARGUMENT,
            "prismNcclSetNextGroup: no ranks".into(),
        );
    }
    // SAFETY: `n` readable ints by the caller's contract.
    let r = unsafe { std::slice::from_raw_parts(ranks, n as usize) };
    if r.iter().any(|&x| x < 0) {
        return fail(
            NCCL_INVALID_ARGUMENT,
            "prismNcclSetNextGroup: a negative rank".into(),
        );
    }
    state().next_group = Some(r.iter().map(|&x| x as u32).collect());
    NCCL_SUCCESS
}

/// `ncclCommInitRank`.
///
/// # Safety
/// `comm` is null or points to a writable `ncclComm_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommInitRank(
    comm: *mut *mut Comm,
    nranks: c_int,
    _id: NcclUniqueId,
    rank: c_int,
) -> c_int {
    if comm.is_null() || nranks <= 0 || rank < 0 || rank >= nranks {
        return fail(
            NCCL_INVALID_ARGUMENT,
            format!("ncclCommInitRank: rank {rank} of {nranks}, comm pointer {comm:?}"),
        );
    }
    let mut st = state();
    if st.session.is_none() {
        let env = st.env.clone();
        let opened =
            Communicator::from_env_with(|k| env.get(k).cloned().or_else(|| std::env::var(k).ok()));
        match opened {
            Ok(c) => st.session = Some(c),
            Err(e) => return fail(NCCL_SYSTEM_ERROR, format!("prism: {e}")),
        }
    }
    let world: u32 = env_var(&st, "PRISM_WORLD_SIZE")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let global = match st.next_group.take() {
        Some(g) if g.len() == nranks as usize => g,
        Some(g) => {
            return fail(
                NCCL_INVALID_USAGE,
                format!(
                    "prism: communicator of {nranks} ranks, but prismNcclSetNextGroup gave {}",
                    g.len()
                ),
            );
        }
        None if nranks as u32 == world => (0..world).collect(),
        None => {
            return fail(
                NCCL_INVALID_USAGE,
                format!(
                    "prism: communicator of {nranks} ranks in a world of {world}: its global ranks are unknown (call prismNcclSetNextGroup first)"
                ),
            );
        }
    };
    if let Some(s) = &st.session
        && global[rank as usize] != s.rank()
    {
        return fail(
            NCCL_INVALID_USAGE,
            format!(
                "prism: group rank {rank} is global rank {}, but this process is rank {}",
                global[rank as usize],
                s.rank()
            ),
        );
    }
    st.comms += 1;
    let c = Box::new(Comm {
        nranks: nranks as u32,
        rank: rank as u32,
        global,
    });
    // SAFETY: non-null and writable by the caller's contract.
    unsafe { *comm = Box::into_raw(c) };
    NCCL_SUCCESS
}

/// `ncclCommInitRankConfig` (the config is ignored).
///
/// # Safety
/// As [`ncclCommInitRank`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommInitRankConfig(
    comm: *mut *mut Comm,
    nranks: c_int,
    id: NcclUniqueId,
    rank: c_int,
    _config: *mut c_void,
) -> c_int {
    // SAFETY: forwarded contract.
    unsafe { ncclCommInitRank(comm, nranks, id, rank) }
}

/// `ncclCommSplit`: refused (the colours of virtual ranks are unknown).
///
/// # Safety
/// None needed; no pointer is read.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommSplit(
    _comm: *mut Comm,
    _color: c_int,
    _key: c_int,
    _newcomm: *mut *mut Comm,
    _config: *mut c_void,
) -> c_int {
    fail(
        NCCL_INVALID_USAGE,
        "prism: ncclCommSplit is not supported (create the group with prismNcclSetNextGroup and ncclCommInitRank)".into(),
    )
}

fn release(comm: *mut Comm) -> c_int {
    if comm.is_null() {
        return fail(NCCL_INVALID_ARGUMENT, "null communicator".into());
    }
    // SAFETY: `comm` came from `Box::into_raw` in `ncclCommInitRank` and is released once.
    drop(unsafe { Box::from_raw(comm) });
    let mut st = state();
    st.comms = st.comms.saturating_sub(1);
    if st.comms == 0
        && let Some(mut s) = st.session.take()
        && let Err(e) = s.finish(0)
    {
        return fail(NCCL_REMOTE_ERROR, format!("prism: {e}"));
    }
    NCCL_SUCCESS
}

/// `ncclCommDestroy`; the last one ends the session with `Bye`.
///
/// # Safety
/// `comm` came from `ncclCommInitRank` and is not used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommDestroy(comm: *mut Comm) -> c_int {
    release(comm)
}

/// `ncclCommAbort`: as [`ncclCommDestroy`].
///
/// # Safety
/// As [`ncclCommDestroy`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommAbort(comm: *mut Comm) -> c_int {
    release(comm)
}

/// `ncclCommFinalize`: nothing to flush.
///
/// # Safety
/// None needed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommFinalize(_comm: *mut Comm) -> c_int {
    NCCL_SUCCESS
}

fn comm_ref<'a>(comm: *const Comm) -> Option<&'a Comm> {
    // SAFETY: a non-null `comm` came from `ncclCommInitRank` and lives until destroyed.
    unsafe { comm.as_ref() }
}

/// `ncclCommCount`.
///
/// # Safety
/// `comm` came from `ncclCommInitRank`; `count` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommCount(comm: *const Comm, count: *mut c_int) -> c_int {
    match (comm_ref(comm), count.is_null()) {
        (Some(c), false) => {
            // SAFETY: non-null and writable by the caller's contract.
            unsafe { *count = c.nranks as c_int };
            NCCL_SUCCESS
        }
        _ => fail(NCCL_INVALID_ARGUMENT, "ncclCommCount: null pointer".into()),
    }
}

/// `ncclCommUserRank`.
///
/// # Safety
/// `comm` came from `ncclCommInitRank`; `rank` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommUserRank(comm: *const Comm, rank: *mut c_int) -> c_int {
    match (comm_ref(comm), rank.is_null()) {
        (Some(c), false) => {
            // SAFETY: non-null and writable by the caller's contract.
            unsafe { *rank = c.rank as c_int };
            NCCL_SUCCESS
        }
        _ => fail(
            NCCL_INVALID_ARGUMENT,
            "ncclCommUserRank: null pointer".into(),
        ),
    }
}

/// `ncclCommCuDevice`: device 0.
///
/// # Safety
/// `device` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommCuDevice(_comm: *const Comm, device: *mut c_int) -> c_int {
    if device.is_null() {
        return fail(
            NCCL_INVALID_ARGUMENT,
            "ncclCommCuDevice: null pointer".into(),
        );
    }
    // SAFETY: non-null and writable by the caller's contract.
    unsafe { *device = 0 };
    NCCL_SUCCESS
}

/// `ncclCommGetAsyncError`: calls are synchronous, so never an asynchronous error.
///
/// # Safety
/// `err` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommGetAsyncError(_comm: *const Comm, err: *mut c_int) -> c_int {
    if !err.is_null() {
        // SAFETY: non-null and writable by the caller's contract.
        unsafe { *err = NCCL_SUCCESS };
    }
    NCCL_SUCCESS
}

/// `ncclGetErrorString`.
#[unsafe(no_mangle)]
pub extern "C" fn ncclGetErrorString(result: c_int) -> *const c_char {
    let s: &'static [u8] = match result {
        0 => b"no error\0",
        1 => b"unhandled cuda error\0",
        2 => b"unhandled system error\0",
        3 => b"internal error\0",
        4 => b"invalid argument\0",
        5 => b"invalid usage\0",
        6 => b"remote process exited or there was a network error\0",
        7 => b"NCCL operation in progress\0",
        _ => b"unknown result code\0",
    };
    s.as_ptr() as *const c_char
}

/// `ncclGetLastError`: this thread's last error message (valid until its next error).
#[unsafe(no_mangle)]
pub extern "C" fn ncclGetLastError(_comm: *const Comm) -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// `ncclGroupStart`: calls run at once.
#[unsafe(no_mangle)]
pub extern "C" fn ncclGroupStart() -> c_int {
    NCCL_SUCCESS
}

/// `ncclGroupEnd`.
#[unsafe(no_mangle)]
pub extern "C" fn ncclGroupEnd() -> c_int {
    NCCL_SUCCESS
}

/// One call: `input` (copied first, so in-place calls are fine) and an output of `out_len`
/// bytes written to `recvbuff`.
#[allow(clippy::too_many_arguments)]
fn run(
    name: &str,
    comm: *const Comm,
    op: Op,
    d: c_int,
    red: ReduceOp,
    peer_group_rank: Option<c_int>,
    sendbuff: *const c_void,
    in_len_elems: usize,
    recvbuff: *mut c_void,
    out_len_elems: usize,
) -> c_int {
    let Some(c) = comm_ref(comm) else {
        return fail(NCCL_INVALID_ARGUMENT, format!("{name}: null communicator"));
    };
    let Some((dt, size)) = dtype(d) else {
        return fail(
            NCCL_INVALID_ARGUMENT,
            format!("{name}: unknown datatype {d}"),
        );
    };
    let peer = match peer_group_rank {
        None => 0,
        Some(p) if p >= 0 && (p as u32) < c.nranks => c.global[p as usize],
        Some(p) => {
            return fail(
                NCCL_INVALID_ARGUMENT,
                format!("{name}: peer {p} outside a communicator of {}", c.nranks),
            );
        }
    };
    let in_len = in_len_elems * size;
    let out_len = out_len_elems * size;
    if (in_len > 0 && sendbuff.is_null()) || (out_len > 0 && recvbuff.is_null()) {
        return fail(NCCL_INVALID_ARGUMENT, format!("{name}: null buffer"));
    }
    let input: Vec<u8> = if in_len == 0 {
        Vec::new()
    } else {
        // SAFETY: a host buffer of `in_len` readable bytes by the caller's contract.
        unsafe { std::slice::from_raw_parts(sendbuff as *const u8, in_len) }.to_vec()
    };
    let mut output = vec![0u8; out_len];
    let group: Vec<u32> = if matches!(op, Op::Send | Op::Recv) {
        Vec::new()
    } else {
        c.global.clone()
    };
    let res = {
        let mut st = state();
        let Some(s) = st.session.as_mut() else {
            return fail(NCCL_INVALID_USAGE, format!("{name}: no session"));
        };
        s.raw(op, &group, dt, red, peer, &input, &mut output)
    };
    if let Err(e) = res {
        return fail(NCCL_REMOTE_ERROR, format!("{name}: {e}"));
    }
    if out_len > 0 {
        // SAFETY: a host buffer of `out_len` writable bytes by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(recvbuff as *mut u8, out_len) }
            .copy_from_slice(&output);
    }
    NCCL_SUCCESS
}

/// `ncclAllReduce`.
///
/// # Safety
/// Host buffers of `count` elements; `comm` from `ncclCommInitRank`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclAllReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    op: c_int,
    comm: *const Comm,
    _stream: *mut c_void,
) -> c_int {
    let Some(r) = reduce_op(op) else {
        return fail(
            NCCL_INVALID_ARGUMENT,
            format!("ncclAllReduce: unknown op {op}"),
        );
    };
    run(
        "ncclAllReduce",
        comm,
        Op::AllReduce,
        datatype,
        r,
        None,
        sendbuff,
        count,
        recvbuff,
        count,
    )
}

/// `ncclReduce`: an all-reduce whose result only the root keeps.
///
/// # Safety
/// Host buffers of `count` elements (`recvbuff` used at the root only).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    op: c_int,
    root: c_int,
    comm: *const Comm,
    _stream: *mut c_void,
) -> c_int {
    let Some(r) = reduce_op(op) else {
        return fail(
            NCCL_INVALID_ARGUMENT,
            format!("ncclReduce: unknown op {op}"),
        );
    };
    let Some(c) = comm_ref(comm) else {
        return fail(
            NCCL_INVALID_ARGUMENT,
            "ncclReduce: null communicator".into(),
        );
    };
    let Some((_, size)) = dtype(datatype) else {
        return fail(
            NCCL_INVALID_ARGUMENT,
            format!("ncclReduce: unknown datatype {datatype}"),
        );
    };
    let mut scratch = vec![0u8; count * size];
    let target = if root == c.rank as c_int {
        recvbuff
    } else {
        scratch.as_mut_ptr() as *mut c_void
    };
    run(
        "ncclReduce",
        comm,
        Op::AllReduce,
        datatype,
        r,
        None,
        sendbuff,
        count,
        target,
        count,
    )
}

/// `ncclBroadcast`.
///
/// # Safety
/// Host buffers of `count` elements (`sendbuff` read at the root).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclBroadcast(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    root: c_int,
    comm: *const Comm,
    _stream: *mut c_void,
) -> c_int {
    let Some(c) = comm_ref(comm) else {
        return fail(
            NCCL_INVALID_ARGUMENT,
            "ncclBroadcast: null communicator".into(),
        );
    };
    let src = if root == c.rank as c_int {
        sendbuff
    } else {
        recvbuff as *const c_void
    };
    run(
        "ncclBroadcast",
        comm,
        Op::Broadcast,
        datatype,
        ReduceOp::Sum,
        Some(root),
        src,
        count,
        recvbuff,
        count,
    )
}

/// `ncclBcast`: in-place broadcast.
///
/// # Safety
/// A host buffer of `count` elements.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclBcast(
    buff: *mut c_void,
    count: usize,
    datatype: c_int,
    root: c_int,
    comm: *const Comm,
    stream: *mut c_void,
) -> c_int {
    // SAFETY: forwarded contract.
    unsafe { ncclBroadcast(buff, buff, count, datatype, root, comm, stream) }
}

/// `ncclAllGather`: `sendcount` elements in, `sendcount * nranks` out.
///
/// # Safety
/// Host buffers of those sizes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclAllGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    sendcount: usize,
    datatype: c_int,
    comm: *const Comm,
    _stream: *mut c_void,
) -> c_int {
    let n = comm_ref(comm).map_or(0, |c| c.nranks as usize);
    run(
        "ncclAllGather",
        comm,
        Op::AllGather,
        datatype,
        ReduceOp::Sum,
        None,
        sendbuff,
        sendcount,
        recvbuff,
        sendcount * n,
    )
}

/// `ncclReduceScatter`: `recvcount * nranks` elements in, `recvcount` out.
///
/// # Safety
/// Host buffers of those sizes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclReduceScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    recvcount: usize,
    datatype: c_int,
    op: c_int,
    comm: *const Comm,
    _stream: *mut c_void,
) -> c_int {
    let Some(r) = reduce_op(op) else {
        return fail(
            NCCL_INVALID_ARGUMENT,
            format!("ncclReduceScatter: unknown op {op}"),
        );
    };
    let n = comm_ref(comm).map_or(0, |c| c.nranks as usize);
    run(
        "ncclReduceScatter",
        comm,
        Op::ReduceScatter,
        datatype,
        r,
        None,
        sendbuff,
        recvcount * n,
        recvbuff,
        recvcount,
    )
}

/// `ncclAllToAll`: `count` elements to and from each rank.
///
/// # Safety
/// Host buffers of `count * nranks` elements.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclAllToAll(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    comm: *const Comm,
    _stream: *mut c_void,
) -> c_int {
    let n = comm_ref(comm).map_or(0, |c| c.nranks as usize);
    run(
        "ncclAllToAll",
        comm,
        Op::AllToAll,
        datatype,
        ReduceOp::Sum,
        None,
        sendbuff,
        count * n,
        recvbuff,
        count * n,
    )
}

/// `ncclSend` to group rank `peer`.
///
/// # Safety
/// A host buffer of `count` elements.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclSend(
    sendbuff: *const c_void,
    count: usize,
    datatype: c_int,
    peer: c_int,
    comm: *const Comm,
    _stream: *mut c_void,
) -> c_int {
    run(
        "ncclSend",
        comm,
        Op::Send,
        datatype,
        ReduceOp::Sum,
        Some(peer),
        sendbuff,
        count,
        std::ptr::null_mut(),
        0,
    )
}

/// `ncclRecv` from group rank `peer`.
///
/// # Safety
/// A host buffer of `count` elements.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclRecv(
    recvbuff: *mut c_void,
    count: usize,
    datatype: c_int,
    peer: c_int,
    comm: *const Comm,
    _stream: *mut c_void,
) -> c_int {
    run(
        "ncclRecv",
        comm,
        Op::Recv,
        datatype,
        ReduceOp::Sum,
        Some(peer),
        std::ptr::null(),
        0,
        recvbuff,
        count,
    )
}
