//! A transport that enqueues each chunk on the stream its caller names for that chunk: an
//! engine whose forward pass moves from stream to stream (torch's current stream, say) sends
//! each chunk on the stream that wrote its pages, so the copy is ordered after them with no
//! cross-stream wait. One in-process [`BackendTransport`] per stream, made on first use, all
//! with the same method.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use super::backend_transport::BackendTransport;
use super::plan::{DecodePlan, SendPlan};
use super::stats::TransferStats;
use super::transport::{Completion, Transport};
use crate::backend::Backend;
use crate::copy::{Method, RemoteSpace};
use crate::error::Result;
use crate::lock::lock;
use crate::pool::DevicePool;

/// Where the next chunk of a [`StreamTransport`] is enqueued: set it before each
/// [`Sender::send`](super::Sender::send). A cheap shared handle.
#[derive(Clone)]
pub struct StreamChoice(Arc<Mutex<Arc<dyn Backend>>>);

impl std::fmt::Debug for StreamChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StreamChoice({:?})", lock(&self.0).stream_id())
    }
}

impl StreamChoice {
    /// Enqueues the next chunks on `stream` (a stream of the sender pool's device).
    pub fn set(&self, stream: Arc<dyn Backend>) {
        *lock(&self.0) = stream;
    }

    /// The stream the next chunk is enqueued on.
    pub fn get(&self) -> Arc<dyn Backend> {
        lock(&self.0).clone()
    }
}

/// Enqueues each chunk on the stream its [`StreamChoice`] names when the chunk is submitted
/// (module docs). Its [`Transport::stats`] count the chunks of every stream together.
pub struct StreamTransport {
    choice: StreamChoice,
    /// `None`: [`BackendTransport::new`]'s method, each launch's grid picked from its blocks.
    method: Option<Method>,
    /// One transport per stream; each holds its stream, so a key is never reused by another.
    by_stream: BTreeMap<usize, BackendTransport>,
    stats: TransferStats,
}

impl std::fmt::Debug for StreamTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamTransport")
            .field("method", &self.method)
            .field("streams", &self.by_stream.len())
            .finish_non_exhaustive()
    }
}

/// The key of a stream: its backend's address (every transport of the map holds its backend).
fn key(stream: &Arc<dyn Backend>) -> usize {
    Arc::as_ptr(stream) as *const () as usize
}

impl StreamTransport {
    /// A transport enqueuing on `first` until its [`StreamChoice`] says otherwise, with
    /// `method` ([`BackendTransport::with_method`]: refused here, before any chunk, when no
    /// in-process transport runs it), or with `None` [`BackendTransport::new`]'s method and
    /// grids.
    pub fn new(first: Arc<dyn Backend>, method: Option<Method>) -> Result<(Self, StreamChoice)> {
        let stats = TransferStats::new("stream");
        let transport = Self::transport(method, first.clone())?;
        let choice = StreamChoice(Arc::new(Mutex::new(first.clone())));
        let by_stream = BTreeMap::from([(key(&first), transport)]);
        let me = Self {
            choice: choice.clone(),
            method,
            by_stream,
            stats,
        };
        Ok((me, choice))
    }

    fn transport(method: Option<Method>, stream: Arc<dyn Backend>) -> Result<BackendTransport> {
        match method {
            None => Ok(BackendTransport::new(stream)),
            Some(m) => BackendTransport::with_method(stream, m),
        }
    }

    /// Streams chunks have been enqueued on so far (the first one counted from the start).
    pub fn streams(&self) -> usize {
        self.by_stream.len()
    }
}

impl StreamTransport {
    /// The transport of the stream the next chunk goes on, made on first use.
    fn current(&mut self) -> Result<&mut BackendTransport> {
        let stream = self.choice.get();
        Ok(match self.by_stream.entry(key(&stream)) {
            std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::btree_map::Entry::Vacant(e) => {
                e.insert(Self::transport(self.method, stream)?)
            }
        })
    }
}

impl Transport for StreamTransport {
    fn submit(
        &mut self,
        plan: &SendPlan,
        src: &Arc<DevicePool>,
        dst: &Arc<RemoteSpace>,
    ) -> Result<Box<dyn Completion>> {
        let transport = self.current()?;
        let started = std::time::Instant::now();
        let result = transport.submit(plan, src, dst);
        // The stream's own transport counted the chunk; these count every stream's together.
        self.stats.submitted(started, result, || {
            Some(super::stats::Posted {
                bytes: plan.bytes().total(),
                descriptors: plan.descriptor_count() as u64,
                post_time: started.elapsed(),
                bounced: false,
            })
        })
    }

    fn submit_decode(
        &mut self,
        plan: &DecodePlan,
        src: &Arc<DevicePool>,
        dsts: &[Arc<RemoteSpace>],
    ) -> Result<Box<dyn Completion>> {
        let transport = self.current()?;
        let started = std::time::Instant::now();
        let result = transport.submit_decode(plan, src, dsts);
        // As for `submit`: one descriptor per decode rank the chunk reaches, as a transport
        // posting them would count.
        self.stats.submitted(started, result, || {
            Some(super::stats::Posted {
                bytes: plan.bytes().total(),
                descriptors: plan.decode_ranks_reached() as u64,
                post_time: started.elapsed(),
                bounced: false,
            })
        })
    }

    fn stats(&self) -> Option<TransferStats> {
        Some(self.stats.clone())
    }
}
