//! The transport contract: a [`Transport`] starts moving one chunk's [`SendPlan`] and hands
//! back a [`Completion`] to poll or wait on; [`TransferStats::submitted`] is what every
//! transport does with that outcome (counts it, and wraps the completion so its landing or its
//! failure is counted once). The transports themselves: in-process ([`super::BackendTransport`]),
//! also into a peer-mapped pool ([`super::BackendTransport::peer`]) and NIXL.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::plan::{DecodePlan, SendPlan};
use super::stats::{Posted, TransferStats};
use crate::copy::RemoteSpace;
use crate::error::{Error, Result};
use crate::pool::DevicePool;

/// A submitted chunk's completion: poll it, or wait for it.
pub trait Completion: Send {
    /// Whether everything the chunk moved has landed; a failure is an `Err`. Never blocks.
    fn poll(&mut self) -> Result<bool>;

    /// Blocks the host until everything the chunk moved has landed, or returns the failure: on
    /// a stream, until the device has passed the chunk's event; on a transfer engine, at most
    /// its transfer timeout.
    fn wait_sync(&mut self) -> Result<()>;

    /// Once the chunk has landed, how long it took to move, when the transport knows better
    /// than the host's wall clock (device events, a transfer engine's telemetry).
    fn transfer_time(&self) -> Option<Duration> {
        None
    }
}

/// Something that moves chunks: an in-process backend ([`BackendTransport`](super::BackendTransport)), a peer mapping,
/// or a network transfer engine (NIXL) that posts the chunk in `submit` and polls it through
/// the returned completion.
pub trait Transport: Send {
    /// Starts moving every page of `plan` from `src` into `dst`. An empty plan is valid and
    /// moves nothing. The completion keeps whatever the transfer needs alive until it lands.
    fn submit(
        &mut self,
        plan: &SendPlan,
        src: &Arc<DevicePool>,
        dst: &Arc<RemoteSpace>,
    ) -> Result<Box<dyn Completion>>;

    /// Starts moving every row of `plan` from `src` into `dsts`, the decode ranks' memory in
    /// rank order (decode context parallelism, docs/dcp.md). A transport that sends only into
    /// unsharded decodes refuses it (the default), before anything moves.
    fn submit_decode(
        &mut self,
        plan: &DecodePlan,
        src: &Arc<DevicePool>,
        dsts: &[Arc<RemoteSpace>],
    ) -> Result<Box<dyn Completion>> {
        let _ = (src, dsts);
        Err(Error::Transfer {
            request: plan.request(),
            reason: "this transport sends only into unsharded decode pools, not into a decode context-parallel layout".into(),
        })
    }

    /// The transport's transfer counters (`super::stats`), shared: they keep counting after
    /// the transport is boxed into a [`Sender`](super::Sender). `None` for a transport that
    /// keeps none.
    fn stats(&self) -> Option<TransferStats> {
        None
    }
}

impl TransferStats {
    /// What every [`Transport::submit`] does with its outcome: a
    /// chunk enqueued at `started` is counted as `posted` says (`None` where the transport
    /// counted its posting itself) and its completion tracked; a failed one counts as failed
    /// and its error is returned.
    pub fn submitted(
        &self,
        started: Instant,
        result: Result<Box<dyn Completion>>,
        posted: impl FnOnce() -> Option<Posted>,
    ) -> Result<Box<dyn Completion>> {
        match result {
            Ok(completion) => {
                if let Some(p) = posted() {
                    self.posted(&p);
                }
                Ok(self.track(completion, started))
            }
            Err(e) => {
                self.failed();
                Err(e)
            }
        }
    }

    /// Wraps `inner`, the completion of a chunk posted at `started`, so that its landing
    /// counts its transfer time (the completion's own [`Completion::transfer_time`] when it
    /// has one, else the wall time since `started`) and its failure counts a failed transfer,
    /// each once.
    pub fn track(&self, inner: Box<dyn Completion>, started: Instant) -> Box<dyn Completion> {
        Box::new(Tracked {
            inner,
            stats: self.clone(),
            started,
            counted: false,
        })
    }
}

/// A completion that counts its outcome into a [`TransferStats`] once.
struct Tracked {
    inner: Box<dyn Completion>,
    stats: TransferStats,
    started: Instant,
    counted: bool,
}

impl Tracked {
    fn count<T>(&mut self, result: &Result<T>, landed: bool) {
        if self.counted {
            return;
        }
        match result {
            Ok(_) if landed => {
                let t = self
                    .inner
                    .transfer_time()
                    .unwrap_or_else(|| self.started.elapsed());
                self.stats.landed(t);
            }
            Ok(_) => return,
            Err(_) => self.stats.failed(),
        }
        self.counted = true;
    }
}

impl Completion for Tracked {
    fn poll(&mut self) -> Result<bool> {
        let r = self.inner.poll();
        let landed = matches!(r, Ok(true));
        self.count(&r, landed);
        r
    }

    fn wait_sync(&mut self) -> Result<()> {
        let r = self.inner.wait_sync();
        self.count(&r, true);
        r
    }

    fn transfer_time(&self) -> Option<Duration> {
        self.inner.transfer_time()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::transfer::stats::Posted;

    struct Fixed(Result<bool>, Option<Duration>);

    impl Completion for Fixed {
        fn poll(&mut self) -> Result<bool> {
            match &self.0 {
                Ok(b) => Ok(*b),
                Err(_) => Err(Error::InvalidArgument("boom".into())),
            }
        }
        fn wait_sync(&mut self) -> Result<()> {
            self.poll().map(|_| ())
        }
        fn transfer_time(&self) -> Option<Duration> {
            self.1
        }
    }

    #[test]
    fn counters_histograms_and_names() {
        let stats = TransferStats::new("test");
        stats.posted(&Posted {
            bytes: 100,
            descriptors: 3,
            post_time: Duration::from_micros(500),
            bounced: true,
        });
        stats.posted(&Posted::default());
        let mut landed = stats.track(
            Box::new(Fixed(Ok(true), Some(Duration::from_millis(20)))),
            Instant::now(),
        );
        assert!(landed.poll().unwrap());
        // Counted once, however often it is polled.
        assert!(landed.poll().unwrap());
        landed.wait_sync().unwrap();
        let mut pending = stats.track(Box::new(Fixed(Ok(false), None)), Instant::now());
        assert!(!pending.poll().unwrap());
        let mut failed = stats.track(
            Box::new(Fixed(Err(Error::InvalidArgument(String::new())), None)),
            Instant::now(),
        );
        assert!(failed.poll().is_err() && failed.wait_sync().is_err());
        stats.failed_notification();

        let s = stats.clone().snapshot();
        assert_eq!(
            (
                s.chunks,
                s.empty_chunks,
                s.bounced_chunks,
                s.bytes,
                s.descriptors
            ),
            (2, 1, 1, 100, 3)
        );
        assert_eq!((s.failed_transfers, s.failed_notifications), (1, 1));
        assert_eq!(s.post_time.count, 2);
        assert_eq!(s.post_time.buckets[0], 2, "both posts under 1 ms");
        assert_eq!(s.transfer_time.count, 1);
        assert_eq!(s.transfer_time.sum, Duration::from_millis(20));
        assert_eq!(
            s.transfer_time.buckets[3], 1,
            "20 ms is in the 25 ms bucket"
        );
        let m = s.metrics();
        let by_vllm = |n: &str| m.iter().find(|x| x.vllm == Some(n)).unwrap().value;
        assert_eq!(by_vllm("vllm:nixl_bytes_transferred_sum"), 100.0);
        assert_eq!(by_vllm("vllm:nixl_num_descriptors_sum"), 3.0);
        assert_eq!(by_vllm("vllm:nixl_num_failed_transfers_total"), 1.0);
        assert_eq!(by_vllm("vllm:nixl_xfer_time_seconds_sum"), 0.02);
        let text = s.prometheus();
        assert!(
            text.contains("kvshard_transfer_bytes_total{transport=\"test\"} 100"),
            "{text}"
        );
        assert!(
            text.contains("kvshard_transfer_seconds_bucket{transport=\"test\",le=\"+Inf\"} 1"),
            "{text}"
        );
        assert!(s
            .to_string()
            .contains("2 chunks (1 empty, 1 bounced), 100 B in 3 descriptors"));
    }
}
