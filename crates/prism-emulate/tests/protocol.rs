//! The emulation wire protocol: round trips, and every way a frame can be bad.

use prism_emulate::protocol::*;
use proptest::prelude::*;

fn call(seq: u64) -> Call {
    Call {
        seq,
        op: Op::AllReduce as i32,
        group: vec![0, 1, 2, 3],
        bytes: 8,
        dtype: DType::F32 as i32,
        reduce: ReduceOp::Sum as i32,
        peer: 0,
        data: vec![0, 0, 128, 63, 0, 0, 0, 64],
        compute_s: 0.0125,
    }
}

fn samples() -> Vec<Body> {
    vec![
        Body::Hello(Hello {
            rank: 5,
            world_size: 8192,
            client: "test".into(),
        }),
        Body::Welcome(Welcome {
            world_size: 8192,
            real_ranks: vec![0, 5],
        }),
        Body::Call(call(17)),
        Body::Done(Done {
            seq: 17,
            emulated_end_s: 1.5,
            data: vec![1, 2, 3],
        }),
        Body::Fault(Fault {
            rank: 3,
            group: vec![2, 3],
            op_index: 9,
            message: "never arrived".into(),
        }),
        Body::Bye(Bye::default()),
    ]
}

#[test]
fn every_message_round_trips_through_a_stream() {
    let mut wire = Vec::new();
    for b in samples() {
        write_frame(&mut wire, &b).unwrap();
    }
    let mut r = wire.as_slice();
    for b in samples() {
        assert_eq!(read_frame(&mut r).unwrap(), Some(b));
    }
    assert_eq!(read_frame(&mut r).unwrap(), None, "clean end of stream");
}

/// The layout `docs/emulate.md` specifies, byte for byte: a big-endian length, then field 1
/// (version, varint) and field 7 (an empty `Bye`).
#[test]
fn a_bye_frame_has_the_documented_bytes() {
    let f = encode_frame(&Body::Bye(Bye::default())).unwrap();
    assert_eq!(
        f,
        vec![0, 0, 0, 4, 0x08, PROTOCOL_VERSION as u8, 0x3a, 0x00]
    );
}

#[test]
fn every_truncation_is_an_error() {
    let f = encode_frame(&Body::Call(call(3))).unwrap();
    for cut in 1..f.len() {
        let err = read_frame(&mut &f[..cut]).unwrap_err();
        assert!(
            matches!(err, ProtocolError::Truncated { .. }),
            "cut at {cut}: {err}"
        );
    }
}

#[test]
fn another_version_is_named() {
    use prost::Message;
    let env = Envelope {
        version: 2,
        body: Some(Body::Bye(Bye::default())),
    };
    let mut f = (env.encoded_len() as u32).to_be_bytes().to_vec();
    env.encode(&mut f).unwrap();
    let err = read_frame(&mut f.as_slice()).unwrap_err();
    assert!(matches!(err, ProtocolError::Version { got: 2 }));
    assert!(err.to_string().contains("version 2"), "{err}");
}

#[test]
fn oversized_empty_and_bodiless_frames_are_refused() {
    let big = (MAX_FRAME + 1).to_be_bytes();
    assert!(matches!(
        read_frame(&mut big.as_slice()),
        Err(ProtocolError::TooLarge { .. })
    ));
    assert!(matches!(
        read_frame(&mut [0u8, 0, 0, 0].as_slice()),
        Err(ProtocolError::Empty)
    ));
    // Version only, no body.
    assert!(matches!(
        read_frame(&mut [0u8, 0, 0, 2, 0x08, 1].as_slice()),
        Err(ProtocolError::NoBody)
    ));
    // A field whose length runs past the frame.
    assert!(matches!(
        read_frame(&mut [0u8, 0, 0, 3, 0x0a, 0x05, 0].as_slice()),
        Err(ProtocolError::Malformed(_))
    ));
}

#[test]
fn calls_are_checked_on_their_own() {
    assert_eq!(call(0).validate(2), Ok(()));
    let bad = |f: &dyn Fn(&mut Call), rank: u32, what: &str| {
        let mut c = call(7);
        f(&mut c);
        let e = c.validate(rank).unwrap_err();
        assert!(e.contains("op 7") && e.contains(what), "{e}");
    };
    bad(&|c| c.op = 0, 0, "not set");
    bad(&|c| c.op = 99, 0, "unknown op");
    bad(&|c| c.dtype = 42, 0, "unknown dtype");
    bad(&|_| {}, 9, "does not hold");
    bad(&|c| c.group = vec![0, 1, 1], 0, "repeats");
    bad(&|c| c.bytes = 12, 0, "bytes of data");
    bad(
        &|c| {
            c.op = Op::Send as i32;
            c.group.clear();
            c.peer = 4;
        },
        4,
        "to itself",
    );
}

proptest! {
    /// Any call round-trips exactly.
    #[test]
    fn calls_round_trip(
        seq in any::<u64>(),
        op in 1i32..=8,
        group in proptest::collection::vec(any::<u32>(), 0..40),
        data in proptest::collection::vec(any::<u8>(), 0..300),
        compute_s in 0.0f64..1e6,
    ) {
        let c = Body::Call(Call { seq, op, group, bytes: data.len() as u64, dtype: 1, reduce: 0,
            peer: 3, data, compute_s });
        let f = encode_frame(&c).unwrap();
        prop_assert_eq!(read_frame(&mut f.as_slice()).unwrap(), Some(c));
    }

    /// Arbitrary bytes give a frame or an error, never a panic.
    #[test]
    fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let mut r = bytes.as_slice();
        for _ in 0..4 {
            match read_frame(&mut r) {
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => break,
            }
        }
    }
}
