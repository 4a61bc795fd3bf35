//! The all-real backend: N processes exchange real data over loopback TCP.
//!
//! Rendezvous: rank 0 listens on the given address; every other rank listens on an ephemeral
//! port of 127.0.0.1, connects to rank 0 and tells it its rank and port; rank 0 answers every
//! rank with the port table. Then each rank connects to every lower rank except 0 (whose
//! rendezvous connection is kept) and accepts the higher ranks: a full mesh.
//!
//! A message on a link: a 17-byte header (op number `u8`, sender's op index `u64` LE, payload
//! length `u64` LE), then the payload. The receiver checks the op and length against its own
//! call, so ranks whose programs disagree fail with a message naming both.
//!
//! Collectives are direct exchanges among the group (each member sends each other member what
//! it needs; a helper thread writes while the caller reads, so large messages cannot deadlock
//! on full socket buffers; writes, like reads, give up after the time-out, so a peer that stops
//! reading cannot hang the call). Reductions run locally over the contributions in group-rank order,
//! so every member computes identical bits and runs repeat exactly.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::{Backend, BackendError, CallSpec, Op, reduce};

/// See the module documentation.
#[derive(Debug)]
pub struct TcpBackend {
    rank: u32,
    /// `links[r]`: the connection to rank `r` (none to itself).
    links: Vec<Option<TcpStream>>,
}

fn io_err(what: &str, e: std::io::Error) -> String {
    format!("{what}: {e}")
}

fn connect_retry(addr: &str, deadline: Instant) -> Result<TcpStream, String> {
    loop {
        match TcpStream::connect(addr) {
            Ok(s) => return Ok(s),
            Err(e) => {
                if Instant::now() >= deadline {
                    return Err(format!("cannot connect to {addr}: {e}"));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

fn accept_deadline(l: &TcpListener, deadline: Instant, what: &str) -> Result<TcpStream, String> {
    l.set_nonblocking(true).map_err(|e| io_err(what, e))?;
    loop {
        match l.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).map_err(|e| io_err(what, e))?;
                return Ok(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(format!("{what}: nobody connected before the time-out"));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(io_err(what, e)),
        }
    }
}

fn read_u32(s: &mut TcpStream) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    s.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

impl TcpBackend {
    /// Joins the mesh of `world` ranks as `rank`; rank 0 listens on `addr` (`HOST:PORT` or
    /// `tcp:HOST:PORT`). Every wait (connect, accept, each read) is bounded by `timeout`.
    pub fn connect(rank: u32, world: u32, addr: &str, timeout: Duration) -> Result<Self, String> {
        if rank >= world {
            return Err(format!("rank {rank} outside a world of {world}"));
        }
        let addr = addr.strip_prefix("tcp:").unwrap_or(addr);
        let deadline = Instant::now() + timeout;
        let mut links: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        if world == 1 {
            return Ok(TcpBackend { rank, links });
        }
        if rank == 0 {
            let l = TcpListener::bind(addr).map_err(|e| io_err(&format!("bind {addr}"), e))?;
            let mut ports = vec![0u16; world as usize];
            for _ in 1..world {
                let mut s = accept_deadline(&l, deadline, &format!("rendezvous on {addr}"))?;
                s.set_read_timeout(Some(timeout))
                    .map_err(|e| io_err("socket", e))?;
                let r = read_u32(&mut s).map_err(|e| io_err("rendezvous hello", e))?;
                let mut p = [0u8; 2];
                s.read_exact(&mut p)
                    .map_err(|e| io_err("rendezvous hello", e))?;
                if r == 0 || r >= world || links[r as usize].is_some() {
                    return Err(format!(
                        "rendezvous: a peer claims rank {r} (world {world})"
                    ));
                }
                ports[r as usize] = u16::from_le_bytes(p);
                links[r as usize] = Some(s);
            }
            let table: Vec<u8> = ports.iter().flat_map(|p| p.to_le_bytes()).collect();
            for s in links.iter_mut().flatten() {
                s.write_all(&table)
                    .map_err(|e| io_err("rendezvous table", e))?;
            }
        } else {
            let l = TcpListener::bind("127.0.0.1:0").map_err(|e| io_err("bind", e))?;
            let port = l.local_addr().map_err(|e| io_err("bind", e))?.port();
            let mut s = connect_retry(addr, deadline)?;
            s.set_read_timeout(Some(timeout))
                .map_err(|e| io_err("socket", e))?;
            s.write_all(&rank.to_le_bytes())
                .and_then(|_| s.write_all(&port.to_le_bytes()))
                .map_err(|e| io_err("rendezvous hello", e))?;
            let mut table = vec![0u8; 2 * world as usize];
            s.read_exact(&mut table)
                .map_err(|e| io_err("rendezvous table from rank 0", e))?;
            links[0] = Some(s);
            for peer in 1..rank {
                let p =
                    u16::from_le_bytes([table[2 * peer as usize], table[2 * peer as usize + 1]]);
                let mut s = connect_retry(&format!("127.0.0.1:{p}"), deadline)?;
                s.write_all(&rank.to_le_bytes())
                    .map_err(|e| io_err(&format!("hello to rank {peer}"), e))?;
                links[peer as usize] = Some(s);
            }
            for _ in rank + 1..world {
                let mut s = accept_deadline(&l, deadline, &format!("rank {rank} mesh"))?;
                s.set_read_timeout(Some(timeout))
                    .map_err(|e| io_err("socket", e))?;
                let r = read_u32(&mut s).map_err(|e| io_err("mesh hello", e))?;
                if r <= rank || r >= world || links[r as usize].is_some() {
                    return Err(format!("mesh: unexpected hello from rank {r}"));
                }
                links[r as usize] = Some(s);
            }
        }
        for s in links.iter().flatten() {
            s.set_read_timeout(Some(timeout))
                .and_then(|_| s.set_write_timeout(Some(timeout)))
                .and_then(|_| s.set_nodelay(true))
                .map_err(|e| io_err("socket", e))?;
        }
        Ok(TcpBackend { rank, links })
    }

    fn link(&self, peer: u32) -> Result<&TcpStream, String> {
        self.links
            .get(peer as usize)
            .and_then(|l| l.as_ref())
            .ok_or_else(|| format!("no connection to rank {peer}"))
    }
}

fn write_msg(mut s: &TcpStream, op: Op, seq: u64, data: &[u8]) -> std::io::Result<()> {
    let mut head = [0u8; 17];
    head[0] = op as u8;
    head[1..9].copy_from_slice(&seq.to_le_bytes());
    head[9..17].copy_from_slice(&(data.len() as u64).to_le_bytes());
    s.write_all(&head)?;
    s.write_all(data)
}

fn read_msg(mut s: &TcpStream, peer: u32, op: Op, out: &mut [u8]) -> Result<(), String> {
    let mut head = [0u8; 17];
    let what = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => format!("rank {peer} closed the connection"),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            format!("rank {peer} sent nothing before the time-out")
        }
        _ => format!("reading from rank {peer}: {e}"),
    };
    s.read_exact(&mut head).map_err(what)?;
    let their_op = head[0];
    let mut q = [0u8; 8];
    q.copy_from_slice(&head[1..9]);
    let their_seq = u64::from_le_bytes(q);
    q.copy_from_slice(&head[9..17]);
    let len = u64::from_le_bytes(q);
    if their_op != op as u8 || len != out.len() as u64 {
        let name = Op::try_from(their_op as i32)
            .map(|o| format!("{o:?}"))
            .unwrap_or_else(|_| format!("op {their_op}"));
        return Err(format!(
            "rank {peer} sent a {name} of {len} bytes (its op {their_seq}) where a {op:?} of {} bytes was expected",
            out.len()
        ));
    }
    s.read_exact(out).map_err(what)
}

impl Backend for TcpBackend {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn call(
        &mut self,
        spec: &CallSpec<'_>,
        input: &[u8],
        output: &mut [u8],
    ) -> Result<(), BackendError> {
        let op = spec.op;
        let seq = spec.seq;
        match op {
            Op::Send => {
                write_msg(self.link(spec.peer)?, op, seq, input)
                    .map_err(|e| format!("sending to rank {}: {e}", spec.peer))?;
                return Ok(());
            }
            Op::Recv => {
                // The sender labels the message Send.
                read_msg(self.link(spec.peer)?, spec.peer, Op::Send, output)?;
                return Ok(());
            }
            _ => {}
        }
        let g = spec.group.len();
        let me = spec
            .group
            .iter()
            .position(|&r| r == self.rank)
            .ok_or_else(|| "the group does not hold this rank".to_string())?;
        let chunk_in = input.len().checked_div(g).unwrap_or(0);
        // What this rank sends to member j, and how many bytes it receives from member j.
        let send_part = |j: usize| -> &[u8] {
            match op {
                Op::AllReduce | Op::AllGather => input,
                Op::ReduceScatter | Op::AllToAll => &input[j * chunk_in..(j + 1) * chunk_in],
                Op::Broadcast if spec.group[me] == spec.peer => input,
                _ => &[],
            }
        };
        let recv_len = match op {
            Op::AllReduce | Op::AllGather => input.len(),
            Op::ReduceScatter | Op::AllToAll => chunk_in,
            Op::Broadcast => input.len(),
            _ => 0,
        };
        let root = spec.peer;
        let sends: Vec<(u32, &[u8])> = (0..g)
            .filter(|&j| j != me)
            .filter(|_| op != Op::Broadcast || spec.group[me] == root)
            .map(|j| (spec.group[j], send_part(j)))
            .collect();
        let from: Vec<usize> = (0..g)
            .filter(|&j| j != me)
            .filter(|&j| op != Op::Broadcast || spec.group[j] == root)
            .collect();
        let mut bufs: Vec<Vec<u8>> = from.iter().map(|_| vec![0u8; recv_len]).collect();
        let links = &self.links;
        let res: Result<(), String> = std::thread::scope(|sc| {
            let writer = sc.spawn(move || -> Result<(), String> {
                for (p, d) in sends {
                    let l = links[p as usize]
                        .as_ref()
                        .ok_or_else(|| format!("no connection to rank {p}"))?;
                    write_msg(l, op, seq, d).map_err(|e| format!("sending to rank {p}: {e}"))?;
                }
                Ok(())
            });
            let mut r = Ok(());
            for (&j, b) in from.iter().zip(bufs.iter_mut()) {
                let p = spec.group[j];
                let l = match links[p as usize].as_ref() {
                    Some(l) => l,
                    None => {
                        r = Err(format!("no connection to rank {p}"));
                        break;
                    }
                };
                if let Err(e) = read_msg(l, p, op, b) {
                    r = Err(e);
                    break;
                }
            }
            let w = writer
                .join()
                .unwrap_or_else(|_| Err("the sending thread panicked".into()));
            r.and(w)
        });
        res?;
        // Member j's part, in group order (this rank's own from `input`).
        let own: &[u8] = match op {
            Op::ReduceScatter | Op::AllToAll => &input[me * chunk_in..(me + 1) * chunk_in],
            _ => input,
        };
        let mut parts: Vec<&[u8]> = Vec::with_capacity(g);
        let mut it = bufs.iter();
        for j in 0..g {
            if j == me {
                parts.push(own);
            } else if from.contains(&j) {
                parts.push(it.next().map(|v| v.as_slice()).unwrap_or(&[]));
            } else {
                parts.push(&[]);
            }
        }
        match op {
            Op::AllReduce | Op::ReduceScatter => {
                reduce::reduce(spec.dtype, spec.reduce, &parts, output)?;
            }
            Op::AllGather | Op::AllToAll => {
                let c = output.len() / g.max(1);
                for (j, p) in parts.iter().enumerate() {
                    output[j * c..(j + 1) * c].copy_from_slice(p);
                }
            }
            Op::Broadcast => {
                let j = spec
                    .group
                    .iter()
                    .position(|&r| r == root)
                    .ok_or_else(|| format!("broadcast root {root} is not in the group"))?;
                output.copy_from_slice(parts[j]);
            }
            _ => {}
        }
        Ok(())
    }

    fn finish(&mut self, _compute_s: f64, _peak: u64) -> Result<(), BackendError> {
        for s in self.links.iter().flatten() {
            let _ = s.shutdown(std::net::Shutdown::Write);
        }
        Ok(())
    }
}
