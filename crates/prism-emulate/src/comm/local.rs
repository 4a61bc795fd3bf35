//! The recording backend: every call completes at once, with the data this rank would get if
//! every member of its group had contributed what it did ([`super::reduce::synthesize`]);
//! receives get zeros. Needs no peers. The communicator's [`super::Trace`] is the recording.

use super::{Backend, BackendError, CallSpec, Op, reduce};

/// See the module documentation.
#[derive(Debug)]
pub struct LocalBackend {
    rank: u32,
}

impl LocalBackend {
    /// The backend of `rank`.
    pub fn new(rank: u32) -> Self {
        LocalBackend { rank }
    }
}

impl Backend for LocalBackend {
    fn name(&self) -> &'static str {
        "local"
    }

    fn call(
        &mut self,
        spec: &CallSpec<'_>,
        input: &[u8],
        output: &mut [u8],
    ) -> Result<(), BackendError> {
        let me = match spec.op {
            Op::Send | Op::Recv => 0,
            _ => spec.group.iter().position(|&r| r == self.rank).unwrap_or(0),
        };
        reduce::synthesize(
            spec.op,
            spec.dtype,
            spec.reduce,
            spec.group_size(),
            me,
            input,
            output,
        )
        .map_err(BackendError::Msg)
    }

    fn finish(&mut self, _compute_s: f64, _peak: u64) -> Result<(), BackendError> {
        Ok(())
    }
}
