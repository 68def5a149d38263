//! Transfer statistics every transport reports: chunks, bytes, descriptors, post time, transfer
//! time and failures, as lock-free counters an engine reads as a [`StatsSnapshot`] at any time,
//! from any thread (and, through the Python package, from Python).
//!
//! A transport owns a [`TransferStats`] (a cheap shared handle: clones count into the same
//! counters) and hands it out through [`Transport::stats`](super::Transport::stats), so the
//! counters keep counting after the transport is boxed into a [`Sender`](super::Sender). What
//! each number means:
//!
//! - **post time**: host time the transport spent handing a chunk to the engine that moves it
//!   (enqueueing launches or copy-engine calls; for NIXL, making and posting the transfer
//!   request), per chunk;
//! - **transfer time**: from the start of the post until the bytes had landed: device time
//!   between timed events where the backend has them, the transfer engine's own telemetry for
//!   NIXL, else the wall time until the completion was seen done;
//! - **descriptors**: address/length pairs the chunk was posted as (after coalescing or bounce
//!   packing; a kernel launch from page lists counts its plan's coalesced descriptors, which is
//!   what a descriptor-based engine would have had to post);
//! - **failures**: chunks whose submission or transfer failed, and notifications that could
//!   not be sent.
//!
//! [`StatsSnapshot::metrics`] names every number the way dashboards already scrape it: vLLM's
//! NIXL connector metrics (`vllm:nixl_*`, histograms with the connector's buckets for times)
//! and KVBM's `kvbm_transfer_*` byte counters (KVBM names a counter by route:
//! `kvbm_transfer_<route>_bytes_total`; a P/D send is route `d2d`).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

/// Upper bounds (seconds) of the time histograms' buckets: vLLM's NIXL connector buckets
/// (`vllm:nixl_post_time_seconds` uses all of them, `vllm:nixl_xfer_time_seconds` from 5 ms);
/// one bucket past the last counts everything longer.
pub const TIME_BUCKETS: [f64; 13] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0,
];

/// A histogram of durations over `TIME_BUCKETS` (plus one overflow bucket), with the sum in
/// nanoseconds.
#[derive(Debug, Default)]
struct TimeHistogram {
    buckets: [AtomicU64; TIME_BUCKETS.len() + 1],
    sum_ns: AtomicU64,
    count: AtomicU64,
}

impl TimeHistogram {
    fn record(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let bucket = TIME_BUCKETS
            .iter()
            .position(|&le| secs <= le)
            .unwrap_or(TIME_BUCKETS.len());
        self.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        // Saturating: a counter of nanoseconds would take 584 years to wrap; never wrap it.
        let _ = self
            .sum_ns
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |s| {
                Some(s.saturating_add(ns))
            });
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    fn snapshot(&self) -> TimeSnapshot {
        TimeSnapshot {
            count: self.count.load(Ordering::Relaxed),
            sum: Duration::from_nanos(self.sum_ns.load(Ordering::Relaxed)),
            buckets: std::array::from_fn(|i| self.buckets[i].load(Ordering::Relaxed)),
        }
    }
}

/// The counters behind a [`TransferStats`] handle.
#[derive(Debug, Default)]
struct Counters {
    chunks: AtomicU64,
    empty_chunks: AtomicU64,
    bytes: AtomicU64,
    descriptors: AtomicU64,
    bounced_chunks: AtomicU64,
    failed_transfers: AtomicU64,
    failed_notifications: AtomicU64,
    post: TimeHistogram,
    transfer: TimeHistogram,
}

/// Shared transfer counters of one transport (clones count into the same counters).
#[derive(Debug, Clone)]
pub struct TransferStats {
    transport: &'static str,
    counters: Arc<Counters>,
}

/// What one chunk was posted as, for [`TransferStats::posted`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Posted {
    /// Bytes the chunk moves.
    pub bytes: u64,
    /// Address/length descriptors it was posted as.
    pub descriptors: u64,
    /// Host time spent posting it.
    pub post_time: Duration,
    /// Whether it went through bounce buffers (packed, one descriptor per component).
    pub bounced: bool,
}

impl TransferStats {
    /// Zeroed counters of a transport named `transport` ("backend", "nixl", ...: the snapshot
    /// carries it, so an exporter can label the metrics).
    pub fn new(transport: &'static str) -> Self {
        Self {
            transport,
            counters: Arc::default(),
        }
    }

    /// The transport's name.
    pub fn transport(&self) -> &'static str {
        self.transport
    }

    /// Counts a chunk handed to the transfer engine (an empty one too: it still reports).
    pub fn posted(&self, posted: &Posted) {
        let c = &self.counters;
        c.chunks.fetch_add(1, Ordering::Relaxed);
        if posted.bytes == 0 {
            c.empty_chunks.fetch_add(1, Ordering::Relaxed);
        }
        if posted.bounced {
            c.bounced_chunks.fetch_add(1, Ordering::Relaxed);
        }
        saturating_add(&c.bytes, posted.bytes);
        saturating_add(&c.descriptors, posted.descriptors);
        c.post.record(posted.post_time);
    }

    /// Counts the transfer time of a chunk that landed.
    pub fn landed(&self, transfer_time: Duration) {
        self.counters.transfer.record(transfer_time);
    }

    /// Counts a chunk whose submission or transfer failed.
    pub fn failed(&self) {
        self.counters
            .failed_transfers
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a notification (a chunk's status to the other side) that could not be sent.
    pub fn failed_notification(&self) {
        self.counters
            .failed_notifications
            .fetch_add(1, Ordering::Relaxed);
    }

    /// The counters now.
    pub fn snapshot(&self) -> StatsSnapshot {
        let c = &self.counters;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        StatsSnapshot {
            transport: self.transport,
            chunks: load(&c.chunks),
            empty_chunks: load(&c.empty_chunks),
            bounced_chunks: load(&c.bounced_chunks),
            bytes: load(&c.bytes),
            descriptors: load(&c.descriptors),
            failed_transfers: load(&c.failed_transfers),
            failed_notifications: load(&c.failed_notifications),
            post_time: c.post.snapshot(),
            transfer_time: c.transfer.snapshot(),
        }
    }
}

fn saturating_add(a: &AtomicU64, v: u64) {
    let _ = a.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |x| {
        Some(x.saturating_add(v))
    });
}

/// A time histogram, read: how many, their sum, and per bucket of `TIME_BUCKETS` (the last
/// entry counts the durations past the last bound). Buckets are not cumulative.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct TimeSnapshot {
    /// Durations recorded.
    pub count: u64,
    /// Their sum.
    pub sum: Duration,
    /// Per bucket.
    pub buckets: [u64; TIME_BUCKETS.len() + 1],
}

impl TimeSnapshot {
    /// The mean, or zero when nothing was recorded.
    pub fn mean(&self) -> Duration {
        if self.count == 0 {
            return Duration::ZERO;
        }
        self.sum / u32::try_from(self.count).unwrap_or(u32::MAX)
    }
}

/// A transport's counters at one moment ([`TransferStats::snapshot`]); serializable, so
/// bindings can hand it over as a dictionary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct StatsSnapshot {
    /// The transport's name.
    pub transport: &'static str,
    /// Chunks posted (empty ones included).
    pub chunks: u64,
    /// Chunks that moved nothing (a rank's empty final chunk, say).
    pub empty_chunks: u64,
    /// Chunks that went through bounce buffers.
    pub bounced_chunks: u64,
    /// Bytes posted.
    pub bytes: u64,
    /// Descriptors posted.
    pub descriptors: u64,
    /// Chunks whose submission or transfer failed.
    pub failed_transfers: u64,
    /// Chunk notifications that could not be sent.
    pub failed_notifications: u64,
    /// Host time spent posting, per chunk.
    pub post_time: TimeSnapshot,
    /// Time until the bytes had landed, per chunk that landed.
    pub transfer_time: TimeSnapshot,
}

/// How a metric aggregates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum MetricKind {
    /// Only ever grows.
    Counter,
    /// The `_sum` or `_count` of a histogram.
    HistogramPart,
}

/// One number of a snapshot, with the names dashboards know it by.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Metric {
    /// kvshard's own name.
    pub name: &'static str,
    /// The vLLM NIXL connector's series this corresponds to, if any.
    pub vllm: Option<&'static str>,
    /// The KVBM series this corresponds to, if any.
    pub kvbm: Option<&'static str>,
    /// How it aggregates.
    pub kind: MetricKind,
    /// The value (seconds for times).
    pub value: f64,
}

impl StatsSnapshot {
    /// Every number, named. vLLM records bytes and descriptors as per-transfer histograms:
    /// their `_sum` is the total here and their `_count` is `chunks`.
    pub fn metrics(&self) -> Vec<Metric> {
        let m = |name, vllm, kvbm, kind, value| Metric {
            name,
            vllm,
            kvbm,
            kind,
            value,
        };
        use MetricKind::{Counter, HistogramPart};
        vec![
            m(
                "kvshard_transfer_chunks_total",
                Some("vllm:nixl_bytes_transferred_count"),
                None,
                Counter,
                self.chunks as f64,
            ),
            m(
                "kvshard_transfer_empty_chunks_total",
                None,
                None,
                Counter,
                self.empty_chunks as f64,
            ),
            m(
                "kvshard_transfer_bounced_chunks_total",
                None,
                None,
                Counter,
                self.bounced_chunks as f64,
            ),
            m(
                "kvshard_transfer_bytes_total",
                Some("vllm:nixl_bytes_transferred_sum"),
                Some("kvbm_transfer_d2d_bytes_total"),
                Counter,
                self.bytes as f64,
            ),
            m(
                "kvshard_transfer_descriptors_total",
                Some("vllm:nixl_num_descriptors_sum"),
                None,
                Counter,
                self.descriptors as f64,
            ),
            m(
                "kvshard_transfer_failures_total",
                Some("vllm:nixl_num_failed_transfers_total"),
                None,
                Counter,
                self.failed_transfers as f64,
            ),
            m(
                "kvshard_transfer_failed_notifications_total",
                Some("vllm:nixl_num_failed_notifications_total"),
                None,
                Counter,
                self.failed_notifications as f64,
            ),
            m(
                "kvshard_transfer_post_seconds_sum",
                Some("vllm:nixl_post_time_seconds_sum"),
                None,
                HistogramPart,
                self.post_time.sum.as_secs_f64(),
            ),
            m(
                "kvshard_transfer_post_seconds_count",
                Some("vllm:nixl_post_time_seconds_count"),
                None,
                HistogramPart,
                self.post_time.count as f64,
            ),
            m(
                "kvshard_transfer_seconds_sum",
                Some("vllm:nixl_xfer_time_seconds_sum"),
                None,
                HistogramPart,
                self.transfer_time.sum.as_secs_f64(),
            ),
            m(
                "kvshard_transfer_seconds_count",
                Some("vllm:nixl_xfer_time_seconds_count"),
                None,
                HistogramPart,
                self.transfer_time.count as f64,
            ),
        ]
    }

    /// The counters in the Prometheus text format, kvshard's names with a `transport` label,
    /// and the two time histograms with cumulative `le` buckets.
    pub fn prometheus(&self) -> String {
        use fmt::Write;
        let mut out = String::new();
        let label = format!("transport=\"{}\"", self.transport);
        for metric in self.metrics() {
            let kind = match metric.kind {
                MetricKind::Counter => "counter",
                MetricKind::HistogramPart => continue,
            };
            let _ = writeln!(out, "# TYPE {} {kind}", metric.name);
            let _ = writeln!(out, "{}{{{label}}} {}", metric.name, metric.value);
        }
        for (name, h) in [
            ("kvshard_transfer_post_seconds", &self.post_time),
            ("kvshard_transfer_seconds", &self.transfer_time),
        ] {
            let _ = writeln!(out, "# TYPE {name} histogram");
            let mut cumulative = 0;
            for (i, n) in h.buckets.iter().enumerate() {
                cumulative += n;
                let le = TIME_BUCKETS
                    .get(i)
                    .map_or_else(|| "+Inf".to_string(), |b| b.to_string());
                let _ = writeln!(out, "{name}_bucket{{{label},le=\"{le}\"}} {cumulative}");
            }
            let _ = writeln!(out, "{name}_sum{{{label}}} {}", h.sum.as_secs_f64());
            let _ = writeln!(out, "{name}_count{{{label}}} {}", h.count);
        }
        out
    }
}

impl fmt::Display for StatsSnapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} chunks ({} empty, {} bounced), {} B in {} descriptors, post {:.1?} (mean {:.1?}), transfer {:.1?} (mean {:.1?}), {} failed, {} failed notifications",
            self.transport,
            self.chunks,
            self.empty_chunks,
            self.bounced_chunks,
            self.bytes,
            self.descriptors,
            self.post_time.sum,
            self.post_time.mean(),
            self.transfer_time.sum,
            self.transfer_time.mean(),
            self.failed_transfers,
            self.failed_notifications
        )
    }
}
