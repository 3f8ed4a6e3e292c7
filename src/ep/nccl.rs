//! The NCCL transport (the `nccl` feature): one process, one communicator per GPU of one host
//! (`ncclCommInitAll`), the all-to-all as grouped point-to-point sends and receives.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::{result as nccl_result, safe::Comm};

use super::{all_to_all_offsets, Lane, Transport};
use crate::error::{Error, Result};

/// N GPUs of one host, rank `r` on the `r`-th device given, each with its own stream and NCCL
/// communicator. NCCL is loaded when the first transport is made (cudarc looks for `libnccl.so`
/// on the loader's path). Dropping the transport waits for its streams (the communicators abort
/// on drop).
#[derive(Debug)]
pub struct NcclTransport {
    comms: Vec<Comm>,
    streams: Vec<Arc<CudaStream>>,
}

impl NcclTransport {
    /// One rank per device ordinal in `devices` (distinct), each on a new stream.
    ///
    /// # Errors
    /// [`Error::Invalid`] for no devices, a repeated or invisible ordinal or no loadable NCCL
    /// library; a CUDA or NCCL error.
    pub fn new(devices: &[usize]) -> Result<Self> {
        if devices.is_empty() {
            return Err(Error::Invalid("an NCCL transport needs at least one device".into()));
        }
        for (i, d) in devices.iter().enumerate() {
            if devices[..i].contains(d) {
                return Err(Error::Invalid(format!("device {d} is listed twice: one rank per GPU")));
            }
        }
        let count = CudaContext::device_count()?;
        if let Some(d) = devices.iter().find(|&&d| d >= count as usize) {
            return Err(Error::Invalid(format!(
                "device {d} is not visible ({count} CUDA device(s)): one rank per GPU, GPUs 0..{count}"
            )));
        }
        // cudarc panics when the library is missing: ask first.
        // SAFETY: only probes for the library with dlopen.
        if !unsafe { cudarc::nccl::sys::is_culib_present() } {
            return Err(Error::Invalid(
                "NCCL was not found (libnccl.so on the loader's path): install NCCL 2.28 or newer".into(),
            ));
        }
        let streams = devices
            .iter()
            .map(|&d| CudaContext::new(d).and_then(|ctx| ctx.new_stream()))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let comms = Comm::from_devices(streams.clone()).map_err(nccl_error)?;
        Ok(NcclTransport { comms, streams })
    }
}

impl Drop for NcclTransport {
    /// Waits for every rank's stream before the communicators go: cudarc's `Comm` aborts its
    /// communicator when dropped, which would cut exchanges still in flight (a step returns with
    /// its work enqueued). Errors are ignored here (a drop cannot report them).
    fn drop(&mut self) {
        for s in &self.streams {
            let _ = s.synchronize();
        }
    }
}

fn nccl_error(e: nccl_result::NcclError) -> Error {
    Error::Core(format!("NCCL: {e:?}"))
}

impl Transport for NcclTransport {
    fn ranks(&self) -> usize {
        self.streams.len()
    }

    fn stream(&self, rank: usize) -> &Arc<CudaStream> {
        &self.streams[rank]
    }

    fn name(&self) -> &'static str {
        "nccl"
    }

    fn all_to_all(&self, lanes: &mut [Lane<'_>], counts: &[Vec<usize>]) -> Result<()> {
        let n = self.comms.len();
        super::check_lanes(lanes, counts, n)?;
        // One group for every lane and rank: a single process drives every rank, so each rank's
        // sends and receives must be in the same group or the first blocking one deadlocks.
        nccl_result::group_start().map_err(nccl_error)?;
        let mut outcome = Ok(());
        'lanes: for lane in lanes.iter_mut() {
            let (send_off, recv_off) = all_to_all_offsets(counts, lane.row_bytes);
            for r in 0..n {
                let comm = &self.comms[r];
                for peer in 0..n {
                    let out = counts[r][peer] * lane.row_bytes;
                    if out > 0 {
                        let v = lane.send[r].slice(send_off[r][peer]..send_off[r][peer] + out);
                        if let Err(e) = comm.send(&v, peer as i32) {
                            outcome = Err(nccl_error(e));
                            break 'lanes;
                        }
                    }
                    let inc = counts[peer][r] * lane.row_bytes;
                    if inc > 0 {
                        let mut v = lane.recv[r].slice_mut(recv_off[r][peer]..recv_off[r][peer] + inc);
                        if let Err(e) = comm.recv(&mut v, peer as i32) {
                            outcome = Err(nccl_error(e));
                            break 'lanes;
                        }
                    }
                }
            }
        }
        // The group is closed even after a failed call (NCCL then reports the error here too).
        let ended = nccl_result::group_end().map(|_| ()).map_err(nccl_error);
        outcome.and(ended)
    }
}
