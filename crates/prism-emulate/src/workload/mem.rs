//! The workload's memory ledger: every tensor of the reference workload is a [`Buf`], whose
//! creation and drop add and remove its bytes on a per-thread counter with a high-water mark.
//!
//! This counts what a GPU's caching allocator counts (tensor bytes), not the process heap: the
//! communicator's own buffers (byte copies, frames, socket state) differ between backends and
//! are not tensors, while every result lands in a `Buf` the workload allocated itself, of the
//! same size whatever the backend. So the peak is a pure function of the configuration and the
//! rank: deterministic and backend-independent (`docs/emulate.md`, "Reference workload").
//! Per-thread, so ranks run as threads of one test process keep separate ledgers; a `Buf` is
//! not `Send`, so it is always dropped on the thread that counted it.

use std::cell::Cell;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

thread_local! {
    static CURRENT: Cell<u64> = const { Cell::new(0) };
    static PEAK: Cell<u64> = const { Cell::new(0) };
}

fn add(bytes: u64) {
    let c = CURRENT.with(|c| {
        let n = c.get() + bytes;
        c.set(n);
        n
    });
    PEAK.with(|p| p.set(p.get().max(c)));
}

fn sub(bytes: u64) {
    CURRENT.with(|c| c.set(c.get().saturating_sub(bytes)));
}

/// Bytes of live [`Buf`]s on this thread.
pub fn current_bytes() -> u64 {
    CURRENT.with(|c| c.get())
}

/// The most bytes of live [`Buf`]s on this thread since the last [`reset_peak`].
pub fn peak_bytes() -> u64 {
    PEAK.with(|p| p.get())
}

/// Restarts the high-water mark at the current bytes.
pub fn reset_peak() {
    let c = current_bytes();
    PEAK.with(|p| p.set(c));
}

/// An `f32` tensor counted on this thread's ledger.
#[derive(Debug)]
pub struct Buf {
    data: Vec<f32>,
    _not_send: PhantomData<*const ()>,
}

impl Buf {
    /// `n` zeros.
    pub fn zeros(n: usize) -> Buf {
        Buf::from_vec(vec![0.0; n])
    }

    /// Takes ownership of `data`, counting it.
    pub fn from_vec(data: Vec<f32>) -> Buf {
        add(4 * data.len() as u64);
        Buf {
            data,
            _not_send: PhantomData,
        }
    }
}

impl Clone for Buf {
    fn clone(&self) -> Buf {
        Buf::from_vec(self.data.clone())
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        sub(4 * self.data.len() as u64);
    }
}

impl Deref for Buf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.data
    }
}

impl DerefMut for Buf {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.data
    }
}
