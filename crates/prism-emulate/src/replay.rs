//! A scripted real rank: replays a list of calls against a coordinator over the protocol (for
//! tests, benchmarks and `prism-replay`). It can stand for a real rank whose compute is known
//! in advance, and it can misbehave on purpose (stop, hang, change a call) to test faults.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use crate::protocol::{Body, Bye, Call, Done, Hello, read_frame, write_frame};

/// How a replay behaves.
#[derive(Clone, Debug, Default)]
pub struct ReplayOptions {
    /// Sleep each call's `compute_s` of wall time before sending it (a rank that really takes
    /// that long); otherwise send at once.
    pub sleep: bool,
    /// Close the connection (as a crash would) before sending call `k`.
    pub crash_before: Option<usize>,
    /// Stop talking (keep the connection open) before sending call `k`, for this long.
    pub hang_before: Option<(usize, Duration)>,
    /// How long to keep trying to connect.
    pub connect_timeout: Duration,
}

/// A stream to the coordinator.
trait Stream: Read + Write + Send {}
impl<T: Read + Write + Send> Stream for T {}

/// Connects to `unix:PATH` or `tcp:127.0.0.1:PORT`, retrying until `timeout` (the coordinator
/// may not listen yet).
fn connect(addr: &str, timeout: Duration) -> Result<Box<dyn Stream>, String> {
    let deadline = Instant::now() + timeout;
    loop {
        let r: std::io::Result<Box<dyn Stream>> = if let Some(p) = addr.strip_prefix("unix:") {
            UnixStream::connect(p).map(|s| Box::new(s) as Box<dyn Stream>)
        } else if let Some(a) = addr.strip_prefix("tcp:") {
            TcpStream::connect(a).map(|s| {
                let _ = s.set_nodelay(true);
                Box::new(s) as Box<dyn Stream>
            })
        } else {
            return Err(format!("`{addr}` is not `unix:PATH` or `tcp:HOST:PORT`"));
        };
        match r {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => {
                return Err(format!("cannot connect to {addr}: {e}"));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
}

/// What a replay saw.
#[derive(Clone, Debug, Default)]
pub struct Replayed {
    /// The `Done` of every call, in order.
    pub done: Vec<Done>,
    /// Wall time from `Welcome` to each `Done`, seconds.
    pub wall_s: Vec<f64>,
    /// The instant each `Done` was read.
    pub done_at: Vec<Instant>,
}

/// Replays `calls` (then `bye`) as `rank` of a `world`-rank job against the coordinator at
/// `addr`. Returns what came back, or the coordinator's `Fault` / the failure as text.
pub fn replay(
    addr: &str,
    rank: u32,
    world: u32,
    calls: &[Call],
    bye: &Bye,
    opts: &ReplayOptions,
) -> Result<Replayed, String> {
    let mut s = connect(addr, opts.connect_timeout)?;
    let io = |e: crate::protocol::ProtocolError| e.to_string();
    write_frame(
        &mut s,
        &Body::Hello(Hello {
            rank,
            world_size: world,
            client: "prism-emulate replay".into(),
        }),
    )
    .map_err(io)?;
    match read_frame(&mut s).map_err(io)? {
        Some(Body::Welcome(_)) => {}
        Some(Body::Fault(f)) => return Err(format!("fault: {}", f.message)),
        other => return Err(format!("expected Welcome, got {other:?}")),
    }
    let t0 = Instant::now();
    let mut out = Replayed::default();
    for (k, c) in calls.iter().enumerate() {
        if opts.crash_before == Some(k) {
            return Ok(out);
        }
        if let Some((at, d)) = opts.hang_before
            && at == k
        {
            std::thread::sleep(d);
            return Ok(out);
        }
        if opts.sleep {
            std::thread::sleep(Duration::from_secs_f64(c.compute_s));
        }
        write_frame(&mut s, &Body::Call(c.clone())).map_err(io)?;
        match read_frame(&mut s).map_err(io)? {
            Some(Body::Done(d)) => {
                if d.seq != c.seq {
                    return Err(format!("Done for seq {} after call {}", d.seq, c.seq));
                }
                out.wall_s.push(t0.elapsed().as_secs_f64());
                out.done_at.push(Instant::now());
                out.done.push(d);
            }
            Some(Body::Fault(f)) => return Err(format!("fault: {}", f.message)),
            other => return Err(format!("expected Done, got {other:?}")),
        }
    }
    if opts.sleep {
        std::thread::sleep(Duration::from_secs_f64(bye.compute_s));
    }
    write_frame(&mut s, &Body::Bye(bye.clone())).map_err(io)?;
    Ok(out)
}
