//! The emulated backend: protocol v1 to the emulation coordinator (`docs/emulate.md`).
//!
//! `Hello` -> `Welcome` on connect; each call sends a `Call` (with `compute_s` and this rank's
//! contribution as `data`) and blocks until the `Done` of the same `seq`, whose `data` is the
//! result; `finish` sends `Bye`. A `Fault` from the coordinator becomes
//! [`super::CommError::Fault`] naming its rank, group and op index. Every wait is bounded: the
//! connection (retried until the coordinator listens) and every read.

use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use super::{Address, Backend, BackendError, CLIENT_NAME, CallSpec, Op};
use crate::conn::Conn;
use crate::protocol::{Body, Hello, ProtocolError, Welcome, read_frame, write_frame};

/// See the module documentation.
#[derive(Debug)]
pub struct EmulatedBackend {
    conn: Conn,
    welcome: Welcome,
    last_end: Option<f64>,
    timeout: Duration,
}

fn describe(e: ProtocolError, timeout: Duration) -> String {
    match e {
        ProtocolError::Io(io)
            if matches!(
                io.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            format!(
                "no answer from the coordinator within {} s",
                timeout.as_secs_f64()
            )
        }
        e => format!("coordinator connection: {e}"),
    }
}

impl EmulatedBackend {
    /// Connects to the coordinator at `addr` (`unix:PATH` or `tcp:HOST:PORT`) as `rank` of
    /// `world`, retrying until `connect_timeout`; every later read waits at most `timeout`.
    pub fn connect(
        rank: u32,
        world: u32,
        addr: &str,
        connect_timeout: Duration,
        timeout: Duration,
    ) -> Result<Self, String> {
        let a = Address::parse(addr)?;
        let deadline = Instant::now() + connect_timeout;
        let conn = loop {
            let r = match &a {
                Address::Unix(p) => UnixStream::connect(p).map(Conn::Unix),
                Address::Tcp(hp) => TcpStream::connect(hp.as_str()).map(Conn::Tcp),
            };
            match r {
                Ok(c) => break c,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(format!("cannot connect to the coordinator at {addr}: {e}")),
            }
        };
        match &conn {
            Conn::Unix(s) => s.set_read_timeout(Some(timeout)),
            Conn::Tcp(s) => s
                .set_read_timeout(Some(timeout))
                .and_then(|_| s.set_nodelay(true)),
        }
        .map_err(|e| format!("coordinator socket: {e}"))?;
        let mut b = EmulatedBackend {
            conn,
            welcome: Welcome::default(),
            last_end: None,
            timeout,
        };
        write_frame(
            &mut b.conn,
            &Body::Hello(Hello {
                rank,
                world_size: world,
                client: CLIENT_NAME.into(),
            }),
        )
        .map_err(|e| describe(e, timeout))?;
        match read_frame(&mut b.conn).map_err(|e| describe(e, timeout))? {
            Some(Body::Welcome(w)) => {
                if w.world_size != world {
                    return Err(format!(
                        "the coordinator emulates a world of {}, this rank believes in {world}",
                        w.world_size
                    ));
                }
                b.welcome = w;
            }
            Some(Body::Fault(f)) => {
                return Err(format!(
                    "the coordinator refused rank {rank}: {} (rank {}, op {})",
                    f.message, f.rank, f.op_index
                ));
            }
            None => return Err("the coordinator closed the connection before Welcome".into()),
            Some(other) => return Err(format!("expected Welcome, got {}", body_name(&other))),
        }
        Ok(b)
    }

    /// The coordinator's `Welcome`.
    pub fn welcome(&self) -> &Welcome {
        &self.welcome
    }
}

fn body_name(b: &Body) -> &'static str {
    match b {
        Body::Hello(_) => "Hello",
        Body::Welcome(_) => "Welcome",
        Body::Call(_) => "Call",
        Body::Done(_) => "Done",
        Body::Fault(_) => "Fault",
        Body::Bye(_) => "Bye",
    }
}

impl Backend for EmulatedBackend {
    fn name(&self) -> &'static str {
        "emulated"
    }

    fn call(
        &mut self,
        spec: &CallSpec<'_>,
        input: &[u8],
        output: &mut [u8],
    ) -> Result<(), BackendError> {
        let bytes = if spec.op == Op::Recv {
            output.len()
        } else {
            input.len()
        };
        let call = spec.to_call(bytes as u64, input.to_vec());
        write_frame(&mut self.conn, &Body::Call(call)).map_err(|e| describe(e, self.timeout))?;
        match read_frame(&mut self.conn).map_err(|e| describe(e, self.timeout))? {
            Some(Body::Done(d)) => {
                if d.seq != spec.seq {
                    return Err(format!(
                        "the coordinator answered op {} while op {} waits",
                        d.seq, spec.seq
                    )
                    .into());
                }
                if d.data.len() != output.len() {
                    return Err(format!(
                        "the coordinator returned {} bytes for a result of {} bytes",
                        d.data.len(),
                        output.len()
                    )
                    .into());
                }
                output.copy_from_slice(&d.data);
                self.last_end = Some(d.emulated_end_s);
                Ok(())
            }
            Some(Body::Fault(f)) => Err(BackendError::Fault(f)),
            None => Err("the coordinator closed the connection".to_string().into()),
            Some(other) => Err(format!("expected Done, got {}", body_name(&other)).into()),
        }
    }

    fn finish(&mut self, compute_s: f64, peak_memory_bytes: u64) -> Result<(), BackendError> {
        write_frame(
            &mut self.conn,
            &Body::Bye(crate::protocol::Bye {
                compute_s,
                peak_memory_bytes,
            }),
        )
        .map_err(|e| describe(e, self.timeout))?;
        Ok(())
    }

    fn emulated_time(&self) -> Option<f64> {
        self.last_end
    }
}
