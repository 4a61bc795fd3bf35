//! The wire protocol between real ranks and the emulation coordinator, version
//! [`PROTOCOL_VERSION`] (specified in `docs/emulate.md`).
//!
//! A connection carries *frames* both ways: a 4-byte big-endian payload length `N`
//! (`1 <= N <=` [`MAX_FRAME`]) followed by `N` bytes, one protobuf-encoded [`Envelope`]. Every
//! envelope carries the protocol version (field 1), so a peer speaking another version is told
//! so by name instead of being misread. Protobuf keeps the format open: a newer peer may add
//! fields (an older one skips them), and a Python client needs only `socket` and `struct`.
//!
//! A session: the real rank sends [`Hello`]; the coordinator answers [`Welcome`] (or [`Fault`]).
//! Then, for each communication call in program order, the rank sends a [`Call`] and waits for
//! its [`Done`], which the coordinator sends at the wall time of the call's emulated
//! completion. A rank ends with [`Bye`]; either side may end with a [`Fault`] naming the rank,
//! the group and the op index.

use std::io::{self, Read, Write};

/// The protocol version this build speaks.
pub const PROTOCOL_VERSION: u32 = 1;

/// The largest payload a frame may declare (64 MiB): a larger length is refused before any
/// allocation.
pub const MAX_FRAME: u32 = 64 << 20;

/// One frame's payload.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Envelope {
    /// [`PROTOCOL_VERSION`] of the sender.
    #[prost(uint32, tag = "1")]
    pub version: u32,
    #[prost(oneof = "Body", tags = "2, 3, 4, 5, 6, 7")]
    pub body: Option<Body>,
}

/// What a frame says.
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Body {
    #[prost(message, tag = "2")]
    Hello(Hello),
    #[prost(message, tag = "3")]
    Welcome(Welcome),
    #[prost(message, tag = "4")]
    Call(Call),
    #[prost(message, tag = "5")]
    Done(Done),
    #[prost(message, tag = "6")]
    Fault(Fault),
    #[prost(message, tag = "7")]
    Bye(Bye),
}

/// Real rank -> coordinator, first frame: who is calling.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Hello {
    /// Global rank in the target job.
    #[prost(uint32, tag = "1")]
    pub rank: u32,
    /// World size the rank believes in (must equal the job's).
    #[prost(uint32, tag = "2")]
    pub world_size: u32,
    /// Free text naming the client ("prism-rust 0.1", "torch 2.11 pg"), for messages.
    #[prost(string, tag = "3")]
    pub client: String,
}

/// Coordinator -> real rank: the session is open.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Welcome {
    /// World size of the emulated job.
    #[prost(uint32, tag = "1")]
    pub world_size: u32,
    /// The ranks that run for real, ascending.
    #[prost(uint32, repeated, tag = "2")]
    pub real_ranks: Vec<u32>,
}

/// A communication operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum Op {
    /// Never sent: a zero (absent) field decodes to it and is refused.
    Unspecified = 0,
    AllReduce = 1,
    ReduceScatter = 2,
    AllGather = 3,
    AllToAll = 4,
    Broadcast = 5,
    Send = 6,
    Recv = 7,
    Barrier = 8,
}

/// Element type of a call's buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum DType {
    /// Opaque bytes (no reduction possible).
    Bytes = 0,
    F32 = 1,
    F16 = 2,
    Bf16 = 3,
    F64 = 4,
    I32 = 5,
    I64 = 6,
    U8 = 7,
}

/// Reduction of a reducing call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum ReduceOp {
    Sum = 0,
    Avg = 1,
    Max = 2,
    Min = 3,
    Product = 4,
}

/// Real rank -> coordinator: one communication call, in the rank's program order.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Call {
    /// The call's index in this rank's program (0, 1, 2, ...): the op index of error messages.
    #[prost(uint64, tag = "1")]
    pub seq: u64,
    #[prost(enumeration = "Op", tag = "2")]
    pub op: i32,
    /// Global ranks of the group, in group-rank order (empty for send and receive).
    #[prost(uint32, repeated, tag = "3")]
    pub group: Vec<u32>,
    /// Bytes this rank contributes (send: the message; receive: the expected message).
    #[prost(uint64, tag = "4")]
    pub bytes: u64,
    #[prost(enumeration = "DType", tag = "5")]
    pub dtype: i32,
    #[prost(enumeration = "ReduceOp", tag = "6")]
    pub reduce: i32,
    /// Peer of a send or receive; root of a broadcast.
    #[prost(uint32, tag = "7")]
    pub peer: u32,
    /// This rank's contribution (empty when the rank sends sizes only).
    #[prost(bytes = "vec", tag = "8")]
    pub data: Vec<u8>,
    /// Seconds of compute since the previous call's release, measured by the rank.
    #[prost(double, tag = "9")]
    pub compute_s: f64,
}

/// Coordinator -> real rank: call `seq` completed in emulated time.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Done {
    #[prost(uint64, tag = "1")]
    pub seq: u64,
    /// Emulated time of completion, seconds from the start of the iteration.
    #[prost(double, tag = "2")]
    pub emulated_end_s: f64,
    /// The call's result for this rank (empty when the call carried no data).
    #[prost(bytes = "vec", tag = "3")]
    pub data: Vec<u8>,
}

/// Either way: the session ends with an error.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Fault {
    /// The rank at fault (the sender's own for a client fault).
    #[prost(uint32, tag = "1")]
    pub rank: u32,
    /// The group of the call at fault (empty when none).
    #[prost(uint32, repeated, tag = "2")]
    pub group: Vec<u32>,
    /// The op index (`Call::seq`) at fault.
    #[prost(uint64, tag = "3")]
    pub op_index: u64,
    #[prost(string, tag = "4")]
    pub message: String,
}

/// Real rank -> coordinator: a clean end. Both fields are optional (zero when absent), so the
/// empty `Bye` of the first drafts stays valid.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Bye {
    /// Seconds of compute after the last call's release (the end of the iteration).
    #[prost(double, tag = "1")]
    pub compute_s: f64,
    /// The rank's peak memory in bytes, as the rank measured it (0: not measured).
    #[prost(uint64, tag = "2")]
    pub peak_memory_bytes: u64,
}

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error("connection error: {0}")]
    Io(#[from] io::Error),
    #[error("truncated frame: the stream ended after {got} of {expected} bytes")]
    Truncated { expected: usize, got: usize },
    #[error("frame of {len} bytes exceeds the limit of {MAX_FRAME} bytes")]
    TooLarge { len: u64 },
    #[error("empty frame: a frame holds at least one byte")]
    Empty,
    #[error("malformed frame: {0}")]
    Malformed(String),
    #[error(
        "protocol version {got} is not supported (this build speaks version {PROTOCOL_VERSION})"
    )]
    Version { got: u32 },
    #[error("frame without a message body")]
    NoBody,
}

impl Envelope {
    /// An envelope of this build's version.
    pub fn new(body: Body) -> Self {
        Envelope {
            version: PROTOCOL_VERSION,
            body: Some(body),
        }
    }
}

/// Encodes `body` as one frame (length prefix included).
pub fn encode_frame(body: &Body) -> Result<Vec<u8>, ProtocolError> {
    use prost::Message;
    let env = Envelope::new(body.clone());
    let len = env.encoded_len();
    if len as u64 > MAX_FRAME as u64 {
        return Err(ProtocolError::TooLarge { len: len as u64 });
    }
    let mut out = Vec::with_capacity(4 + len);
    out.extend_from_slice(&(len as u32).to_be_bytes());
    env.encode(&mut out)
        .map_err(|e| ProtocolError::Malformed(e.to_string()))?;
    Ok(out)
}

/// Writes `body` as one frame and flushes.
pub fn write_frame(w: &mut impl Write, body: &Body) -> Result<(), ProtocolError> {
    w.write_all(&encode_frame(body)?)?;
    w.flush()?;
    Ok(())
}

/// Reads one frame: `Ok(None)` at a clean end of stream (before a frame's first byte), the body
/// otherwise; a short, oversized, malformed or other-version frame is an error.
pub fn read_frame(r: &mut impl Read) -> Result<Option<Body>, ProtocolError> {
    use prost::Message;
    let mut head = [0u8; 4];
    let got = read_full(r, &mut head)?;
    if got == 0 {
        return Ok(None);
    }
    if got < 4 {
        return Err(ProtocolError::Truncated { expected: 4, got });
    }
    let len = u32::from_be_bytes(head);
    if len == 0 {
        return Err(ProtocolError::Empty);
    }
    if len > MAX_FRAME {
        return Err(ProtocolError::TooLarge { len: len as u64 });
    }
    let mut payload = vec![0u8; len as usize];
    let got = read_full(r, &mut payload)?;
    if got < payload.len() {
        return Err(ProtocolError::Truncated {
            expected: 4 + payload.len(),
            got: 4 + got,
        });
    }
    let env = Envelope::decode(payload.as_slice())
        .map_err(|e| ProtocolError::Malformed(e.to_string()))?;
    if env.version != PROTOCOL_VERSION {
        return Err(ProtocolError::Version { got: env.version });
    }
    env.body.ok_or(ProtocolError::NoBody).map(Some)
}

/// Reads until `buf` is full or the stream ends; returns the bytes read.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

impl Call {
    /// Checks what a call must satisfy on its own, for the rank `rank` that sent it: a known,
    /// specified op, dtype and reduction; a collective's group non-empty, without repeats and
    /// holding `rank`; a send or receive with an empty group and a peer other than `rank`;
    /// data, when given, of `bytes` bytes. The message names the op index.
    pub fn validate(&self, rank: u32) -> Result<(), String> {
        let at = format!("rank {rank}, op {}", self.seq);
        let op =
            Op::try_from(self.op).map_err(|_| format!("{at}: unknown op number {}", self.op))?;
        DType::try_from(self.dtype)
            .map_err(|_| format!("{at}: unknown dtype number {}", self.dtype))?;
        ReduceOp::try_from(self.reduce)
            .map_err(|_| format!("{at}: unknown reduction number {}", self.reduce))?;
        match op {
            Op::Unspecified => return Err(format!("{at}: the op is not set")),
            Op::Send | Op::Recv => {
                if !self.group.is_empty() {
                    return Err(format!("{at}: a {op:?} names a peer, not a group"));
                }
                if self.peer == rank {
                    return Err(format!("{at}: a {op:?} to itself"));
                }
            }
            _ => {
                if !self.group.contains(&rank) {
                    return Err(format!(
                        "{at}: group {:?} does not hold the rank",
                        self.group
                    ));
                }
                let mut g = self.group.clone();
                g.sort_unstable();
                if g.windows(2).any(|w| w[0] == w[1]) {
                    return Err(format!("{at}: group {:?} repeats a rank", self.group));
                }
            }
        }
        if !self.data.is_empty() && self.data.len() as u64 != self.bytes {
            return Err(format!(
                "{at}: {} bytes of data for a call of {} bytes",
                self.data.len(),
                self.bytes
            ));
        }
        Ok(())
    }
}
