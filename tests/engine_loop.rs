//! The engine's loop (docs/design.md, "The engine's loop"): `PrefillLoop::step` polls every
//! chunk in flight in any order, `Receiver::step` takes the statuses as they come and expires
//! what is overdue, `HiCacheController::step` acks every backup and load that completed, and
//! each reports kernel-reported errors, all without a host wait. Chunks here land out of order:
//! each goes to a stream drawn at random, and the CPU twin runs its streams in adversarial order.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::pd::{self, Request, N};
use common::Device;
use kvshard::abi;
use kvshard::backend::cpu::StreamOrder;
use kvshard::backend::{sync_counts, Backend, Launch, MemoryKind};
use kvshard::chain::RequestChain;
use kvshard::copy::{Method, RemoteSpace};
use kvshard::hicache::{CacheNode, HiCacheController, HostLayout, HostPool, Streams, WritePolicy};
use kvshard::pool::DevicePool;
use kvshard::shard::ShardAllocator;
use kvshard::transfer::{
    BackendTransport, ChunkEnd, ChunkResult, ChunkStatus, Completion, DecodePlan, Finished,
    Outcome, PrefillLoop, Receiver, SendPlan, Sender, Transport,
};
use kvshard::{Error, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A transport that puts each chunk on one of several streams, drawn at random, and reports
/// it landed only after a random number of polls more, so chunks of one rank land in any
/// order; the chunks named in `fail` fail once they have landed.
struct Scattered {
    streams: Vec<BackendTransport>,
    rng: StdRng,
    fail: BTreeSet<(u64, u32)>,
}

impl Scattered {
    fn new(device: &Device, streams: usize, seed: u64) -> Self {
        Self {
            streams: (0..streams)
                .map(|_| BackendTransport::new(device.stream()))
                .collect(),
            rng: StdRng::seed_from_u64(seed),
            fail: BTreeSet::new(),
        }
    }
}

/// A completion that says "not yet" `polls` more times after the chunk it wraps has landed:
/// a transport that reports chunks late, and in another order than they were sent.
struct Late {
    inner: Box<dyn Completion>,
    polls: u32,
}

impl Completion for Late {
    fn poll(&mut self) -> Result<bool> {
        if !self.inner.poll()? {
            return Ok(false);
        }
        if self.polls == 0 {
            return Ok(true);
        }
        self.polls -= 1;
        Ok(false)
    }

    fn wait_sync(&mut self) -> Result<()> {
        self.inner.wait_sync()
    }
}

/// A completion that fails once the chunk it wraps has landed.
struct FailsWhenLanded(Box<dyn Completion>);

impl Completion for FailsWhenLanded {
    fn poll(&mut self) -> Result<bool> {
        if self.0.poll()? {
            return Err(Error::InvalidArgument(
                "an injected transfer failure".into(),
            ));
        }
        Ok(false)
    }

    fn wait_sync(&mut self) -> Result<()> {
        self.0.wait_sync()?;
        Err(Error::InvalidArgument(
            "an injected transfer failure".into(),
        ))
    }
}

impl Transport for Scattered {
    fn submit(
        &mut self,
        plan: &SendPlan,
        src: &Arc<DevicePool>,
        dst: &Arc<RemoteSpace>,
    ) -> Result<Box<dyn Completion>> {
        let at = self.rng.random_range(0..self.streams.len());
        let done = self.streams[at].submit(plan, src, dst)?;
        let done: Box<dyn Completion> = if self.fail.contains(&(plan.request(), plan.chunk().index))
        {
            Box::new(FailsWhenLanded(done))
        } else {
            done
        };
        Ok(Box::new(Late {
            inner: done,
            polls: self.rng.random_range(0..12),
        }))
    }

    fn submit_decode(
        &mut self,
        plan: &DecodePlan,
        src: &Arc<DevicePool>,
        dsts: &[Arc<RemoteSpace>],
    ) -> Result<Box<dyn Completion>> {
        self.streams[0].submit_decode(plan, src, dsts)
    }
}

/// The CP group's loop (both ranks in this process), the decode pool and its receiver, every
/// request of `requests` opened on both sides.
struct Group {
    prefill: PrefillLoop,
    receiver: Receiver,
    decode: Arc<DevicePool>,
    decode_stream: Arc<dyn Backend>,
}

fn group(device: &Device, requests: &[Request], seed: u64, fail: &[(u32, u64, u32)]) -> Group {
    let decode_stream = device.stream();
    let decode = pd::decode_pool(decode_stream.as_ref());
    let dst = Arc::new(RemoteSpace::of(decode.clone(), pd::geometry()).expect("remote"));
    let mut prefill = PrefillLoop::new();
    let mut receiver = Receiver::new();
    for rank in 0..N {
        let stream = device.stream();
        let pool = pd::prefill_pool(stream.as_ref(), seed, rank);
        let mut transport = Scattered::new(device, 3, seed + u64::from(rank));
        transport.fail = fail
            .iter()
            .filter(|f| f.0 == rank)
            .map(|&(_, request, chunk)| (request, chunk))
            .collect();
        prefill
            .add(Sender::new(pool, Box::new(transport)))
            .expect("a rank of its own");
        prefill.watch(stream);
    }
    for r in requests {
        receiver
            .register(r.registration.clone(), N)
            .expect("register");
        for rank in 0..N {
            let sender = prefill.sender(rank).expect("rank");
            sender
                .open(r.registration.clone(), dst.clone())
                .expect("open");
        }
    }
    Group {
        prefill,
        receiver,
        decode,
        decode_stream,
    }
}

/// What a run of the loop saw.
#[derive(Default)]
struct Seen {
    finished: BTreeMap<u64, Finished>,
    refused: Vec<Error>,
    kernel_errors: Vec<Error>,
    failed_on_rank: BTreeSet<(u32, u64)>,
    /// Per (rank, request), the chunks delivered; and how many came ahead of an earlier one.
    delivered: BTreeMap<(u32, u64), BTreeSet<u32>>,
    ahead: usize,
}

impl Group {
    /// One scheduling step: the prefill side's, its statuses straight to the decode side's.
    fn step(&mut self, seen: &mut Seen) {
        let sent = self.prefill.step();
        seen.kernel_errors.extend(sent.kernel_errors);
        for s in &sent.statuses {
            if matches!(s.result, ChunkResult::Failed { .. }) {
                seen.failed_on_rank.insert((s.rank, s.request));
            }
            let mine = seen.delivered.entry((s.rank, s.request)).or_default();
            if (0..s.chunk).any(|c| !mine.contains(&c)) {
                seen.ahead += 1;
            }
            mine.insert(s.chunk);
        }
        let got = self.receiver.step(sent.statuses);
        seen.refused.extend(got.refused);
        assert!(got.overdue.is_empty(), "nothing is overdue here");
        for done in got.finished {
            let request = done.request();
            assert!(
                seen.finished.insert(request, done).is_none(),
                "request {request} finished twice"
            );
        }
    }

    /// Sends every chunk of `requests` on every rank, each (request, rank) in chunk order and
    /// the pairs interleaved at random, stepping now and then between sends; then steps until
    /// every request finished. The engine's side of the loop, with no host wait of its own.
    fn run(&mut self, requests: &[Request], rng: &mut StdRng) -> Seen {
        let mut seen = Seen::default();
        // Per (request, rank): the next chunk to send.
        let mut next: Vec<(usize, u32, usize)> = (0..requests.len())
            .flat_map(|r| (0..N).map(move |rank| (r, rank, 0)))
            .collect();
        while !next.is_empty() {
            let at = rng.random_range(0..next.len());
            let (r, rank, c) = next[at];
            let req = &requests[r];
            let request = req.registration.request;
            // The engine heard the rank failed the request: it sends no more of it. A chunk
            // refused at send (it failed meanwhile) comes out of a step as the failure.
            if !seen.failed_on_rank.contains(&(rank, request)) {
                let _ = self
                    .prefill
                    .send(rank, request, &req.src_pages, req.chunks[c]);
            }
            if c + 1 < req.chunks.len() {
                next[at].2 += 1;
            } else {
                next.swap_remove(at);
            }
            if rng.random_bool(0.25) {
                self.step(&mut seen);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        while seen.finished.len() < requests.len() {
            assert!(
                Instant::now() < deadline,
                "{} of {} requests finished",
                seen.finished.len(),
                requests.len()
            );
            self.step(&mut seen);
            std::thread::sleep(Duration::from_micros(200));
        }
        assert_eq!(self.prefill.in_flight(), 0);
        seen
    }
}

// Every chunk of every request on both ranks, landing out of order, is delivered once and
// each request finishes once, completed, its decode pages byte-identical to the in-process
// reference; the loop never waits on the host.
common::on_cpu_and_gpu!(
    the_loop_delivers_every_chunk_and_finishes_each_request_once,
    [StreamOrder::Immediate, StreamOrder::Adversarial(11)],
    |device| {
        let mut rng = device.rng();
        let mut ahead = 0;
        // A few rounds, so that some statuses surely come ahead of an earlier chunk's.
        for _ in 0..4 {
            let seed = rng.random::<u64>();
            let requests = pd::requests(seed);
            let mut g = group(&device, &requests, seed, &[]);
            let before = sync_counts();
            let seen = g.run(&requests, &mut rng);
            assert_eq!(
                (sync_counts() - before).host_blocking,
                0,
                "{device}: the loop waited on the host"
            );
            assert!(seen.refused.is_empty(), "{device}: {:?}", seen.refused);
            assert!(seen.kernel_errors.is_empty(), "{device}");
            for done in seen.finished.values() {
                assert!(done.is_completed(), "{device}: {:?}", done.outcome);
            }
            let got = g
                .decode
                .snapshot_sync(g.decode_stream.as_ref())
                .expect("snapshot");
            assert!(
                got == pd::reference(seed, &requests),
                "{device}: the decode pool differs from the in-process reference"
            );
            ahead += seen.ahead;
        }
        // The CPU twin's adversarial order makes statuses overtake for sure; on a GPU that is
        // the device's timing (a tool that serializes it, compute-sanitizer, never does), and
        // the bytes above are checked either way.
        if !device.is_gpu() {
            assert!(ahead > 0, "{device}: every status came in chunk order");
        }
    }
);

// A chunk that fails while moving fails its request: its failed status goes out once nothing
// else of the request moves on the rank, after the chunks before it, and the decode side takes
// every status without refusing one; the other requests complete.
common::on_cpu_and_gpu!(
    a_chunk_failing_in_flight_fails_its_request_after_the_chunks_before_it,
    [StreamOrder::Immediate, StreamOrder::Adversarial(5)],
    |device| {
        let seed = device.rng().random::<u64>();
        let requests = pd::requests(seed);
        // Request 1's chunk 1 on rank 0, request 2's chunk 0 on rank 1.
        let fail = [(0, 1, 1), (1, 2, 0)];
        let mut g = group(&device, &requests, seed, &fail);
        let seen = g.run(&requests, &mut device.rng());
        assert!(seen.refused.is_empty(), "{device}: {:?}", seen.refused);
        for (request, done) in &seen.finished {
            match fail.iter().find(|f| f.1 == *request) {
                Some(&(rank, _, chunk)) => match &done.outcome {
                    Outcome::Failed(why) => {
                        assert_eq!(why.len(), 1, "{device}: {why:?}");
                        assert_eq!((why[0].rank, why[0].chunk), (rank, chunk), "{device}");
                    }
                    Outcome::Completed => panic!("{device}: request {request} completed"),
                },
                None => assert!(done.is_completed(), "{device}: request {request}"),
            }
        }
        for &(rank, request, _) in &fail {
            let sender = g.prefill.sender(rank).expect("rank");
            assert!(
                sender.abort(request, "again").is_err(),
                "{device}: request {request} is closed on rank {rank}"
            );
        }
    }
);

// An aborted request's failed status waits for its chunks in flight; a chunk dropped outside
// the loop is reported by it; a request a rank never finishes surfaces through the decode
// side's step as overdue, naming the rank.
common::on_cpu_and_gpu!(
    aborts_drops_and_deadlines_surface_through_the_steps,
    [StreamOrder::Adversarial(3)],
    |device| {
        let seed = device.rng().random::<u64>();
        let requests = pd::requests(seed);
        let (a, b) = (&requests[0], &requests[1]);
        let mut g = group(&device, std::slice::from_ref(a), seed, &[]);
        for rank in 0..N {
            g.prefill
                .send(rank, a.registration.request, &a.src_pages, a.chunks[0])
                .expect("send");
            g.prefill
                .abort(rank, a.registration.request, "the engine cancelled it")
                .expect("abort");
        }
        // Request b, due 1 ms after registration: rank 0's first chunk is sent outside the
        // loop and dropped; rank 1 never sends.
        let b_id = b.registration.request;
        g.receiver
            .register_with_deadline(b.registration.clone(), N, Duration::from_millis(1))
            .expect("register");
        let dst = Arc::new(RemoteSpace::of(g.decode.clone(), pd::geometry()).expect("remote"));
        let rank0 = g.prefill.sender(0).expect("rank 0");
        rank0.open(b.registration.clone(), dst).expect("open");
        drop(rank0.send(b_id, &b.src_pages, b.chunks[0]).expect("send"));
        let mut seen = Seen::default();
        let mut overdue = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !seen.finished.contains_key(&a.registration.request) || overdue.is_empty() {
            assert!(
                Instant::now() < deadline,
                "{device}: the steps never settled"
            );
            let sent = g.prefill.step();
            let got = g.receiver.step(sent.statuses);
            seen.refused.extend(got.refused);
            overdue.extend(got.overdue);
            for done in got.finished {
                seen.finished.insert(done.request(), done);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(seen.refused.is_empty(), "{device}: {:?}", seen.refused);
        match &seen.finished[&a.registration.request].outcome {
            Outcome::Failed(why) => assert!(
                why.len() == 2
                    && why
                        .iter()
                        .all(|f| f.reason.contains("the engine cancelled it")),
                "{device}: {why:?}"
            ),
            other => panic!("{device}: {other:?}"),
        }
        assert_eq!(overdue.len(), 1, "{device}: {overdue:?}");
        assert_eq!(overdue[0].request, b_id);
        let missing: Vec<u32> = overdue[0].missing.iter().map(|m| m.rank).collect();
        // Rank 0's dropped chunk was its last status; rank 1 never sent.
        assert_eq!(missing, vec![1], "{device}");
        // The engine answers for rank 1 (its process is gone, say): b is handed back, failed.
        let done = g
            .receiver
            .receive(ChunkStatus {
                request: b_id,
                rank: 1,
                chunk: 0,
                result: ChunkResult::Failed {
                    reason: "gone".into(),
                },
            })
            .expect("taken")
            .expect("every rank reported");
        assert!(!done.is_completed(), "{device}");
    }
);

/// A launch on `stream` that rejects its input: `kvs_copy_ranges` with a range longer than it
/// takes. Returns the memory it reads.
fn rejected_launch(stream: &dyn Backend) -> Vec<kvshard::backend::Buffer> {
    let src = stream.alloc(64, MemoryKind::Device).expect("alloc");
    let table: Vec<u8> = [src.addr(), src.addr(), abi::KVS_COPY_RANGE_MAX_BYTES + 1]
        .into_iter()
        .flat_map(u64::to_le_bytes)
        .collect();
    let ranges = stream
        .alloc(table.len(), MemoryKind::Device)
        .expect("alloc");
    stream.write_sync(&ranges, 0, &table).expect("write");
    let p = abi::kvs_copy_ranges_params {
        ranges: ranges.addr(),
        num_ranges: 1,
        status: abi::kvs_status::default(),
    };
    // SAFETY: the one range is too long, so it is skipped before its addresses are read; the
    // table outlives the launch (returned to the caller, which keeps it until the end).
    unsafe {
        stream
            .copy_ranges(
                p,
                Launch {
                    ctas: 1,
                    threads: 64,
                },
            )
            .expect("launch")
    };
    vec![src, ranges]
}

// An input a kernel rejected on a watched stream surfaces through the next steps, once,
// without a host wait.
common::on_cpu_and_gpu!(
    kernel_rejected_inputs_surface_through_the_step,
    [StreamOrder::Immediate, StreamOrder::Adversarial(9)],
    |device| {
        let stream = device.stream();
        let mut prefill = PrefillLoop::new();
        prefill.watch(stream.clone());
        let _keep = rejected_launch(stream.as_ref());
        let before = sync_counts();
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut errors = Vec::new();
        while errors.is_empty() {
            assert!(Instant::now() < deadline, "{device}: never reported");
            errors = prefill.step().kernel_errors;
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!((sync_counts() - before).host_blocking, 0, "{device}");
        assert!(
            matches!(
                errors.as_slice(),
                [Error::KernelRejected {
                    kernel: "kvs_copy_ranges",
                    position: 0
                }]
            ),
            "{device}: {errors:?}"
        );
        for _ in 0..3 {
            assert!(
                prefill.step().kernel_errors.is_empty(),
                "{device}: reported once"
            );
        }
    }
);

#[test]
fn a_rank_is_added_once_and_a_send_to_no_rank_changes_nothing() {
    let device_stream: Arc<dyn Backend> = Arc::new(kvshard::backend::cpu::CpuBackend::new());
    let pool = pd::prefill_pool(device_stream.as_ref(), 1, 0);
    let mut prefill = PrefillLoop::new();
    let transport = || Box::new(BackendTransport::new(device_stream.clone()));
    prefill
        .add(Sender::new(pool.clone(), transport()))
        .expect("add");
    let e = prefill
        .add(Sender::new(pool, transport()))
        .unwrap_err()
        .to_string();
    assert!(e.contains("prefill rank 0 is in the loop already"), "{e}");
    let e = prefill
        .send(1, 7, &[], ChunkEnd::Final(0))
        .unwrap_err()
        .to_string();
    assert!(e.contains("prefill rank 1 is not in the loop"), "{e}");
    let e = prefill
        .send(0, 7, &[], ChunkEnd::Final(0))
        .unwrap_err()
        .to_string();
    assert!(e.contains("not open on prefill rank 0"), "{e}");
    assert_eq!(prefill.in_flight(), 0);
    assert!(prefill.step().statuses.is_empty());
}

// Every backup and every load of every rank is acked by the controllers' steps, in submission
// order, with no host wait and no hand-written polling of counts; the reloaded pages equal the
// backed-up ones.
common::on_cpu_and_gpu!(
    hicache_steps_ack_every_backup_and_load,
    [StreamOrder::Immediate, StreamOrder::Adversarial(13)],
    |device| {
        let seed = device.rng().random::<u64>();
        let compute = device.stream();
        let placement = kvshard::shard::Placement::new(N).expect("placement");
        let mut controllers = Vec::new();
        for rank in 0..N {
            let pool = pd::prefill_pool(compute.as_ref(), seed, rank);
            let host = HostPool::new(
                compute.as_ref(),
                &pd::geometry(),
                pd::PREFILL_PAGES,
                HostLayout::PageFirst,
            )
            .expect("host pool");
            let streams = Streams::each(|| Ok(device.stream())).expect("streams");
            controllers.push(
                HiCacheController::new(pool, Arc::new(host), streams, WritePolicy::WriteThrough)
                    .expect("controller"),
            );
        }
        // Three nodes of 4 pages each, every rank's share of them.
        let mut alloc = ShardAllocator::new(placement, pd::PREFILL_PAGES).expect("allocator");
        let mut nodes = Vec::new();
        for id in 0..3u64 {
            let mut chain = RequestChain::new(placement);
            chain.grow_to(&mut alloc, 4 * 64).expect("pages");
            nodes.push(CacheNode::of_chain(&chain, id, 0..4).expect("node"));
        }
        let before = sync_counts();
        let done = compute.record().expect("event");
        for c in &mut controllers {
            for node in &nodes {
                c.access(node, &done, Method::CopyEngine).expect("backup");
            }
        }
        let mut backed = vec![Vec::new(); controllers.len()];
        let deadline = Instant::now() + Duration::from_secs(30);
        while backed.iter().any(|b| b.len() < nodes.len()) {
            assert!(Instant::now() < deadline, "{device}: backups never acked");
            for (c, got) in controllers.iter_mut().zip(&mut backed) {
                let step = c.step().expect("step");
                assert!(
                    step.loads.is_empty() && step.kernel_errors.is_empty(),
                    "{device}"
                );
                got.extend(step.backups.into_iter().map(|a| a.index));
            }
        }
        for got in &backed {
            assert_eq!(got, &vec![0, 1, 2], "{device}: acked once each, in order");
        }
        // Reload every node into new pages, layer by layer on a consumer stream.
        let consumer = device.stream();
        let mut reloads = Vec::new();
        for node in &nodes {
            let pages = alloc.alloc_matching(&node.device_pages).expect("pages");
            for c in &mut controllers {
                let handle = c
                    .load(node.id, &pages, None, Method::CopyEngine)
                    .expect("load");
                handle
                    .wait_layer(consumer.as_ref(), kvshard::index::ModelLayer(0))
                    .expect("wait");
            }
            reloads.push(pages);
        }
        let mut loaded = vec![0; controllers.len()];
        while loaded.iter().any(|&n| n < nodes.len()) {
            assert!(Instant::now() < deadline, "{device}: loads never acked");
            for (c, got) in controllers.iter_mut().zip(&mut loaded) {
                let step = c.step().expect("step");
                *got += step.loads.len();
            }
        }
        assert_eq!(
            (sync_counts() - before).host_blocking,
            0,
            "{device}: a step waited on the host"
        );
        for c in &controllers {
            assert_eq!((c.pending_backups(), c.pending_loads()), (0, 0));
        }
        for (node, pages) in nodes.iter().zip(&reloads) {
            for c in &controllers {
                let pool = c.device();
                let owned = |list: &[kvshard::index::LogicalPage]| -> Vec<_> {
                    list.iter()
                        .filter(|&&p| placement.owner(p) == pool.rank())
                        .map(|&p| placement.local(p))
                        .collect()
                };
                let was = pool
                    .read_pages_sync(compute.as_ref(), &owned(&node.device_pages))
                    .expect("read");
                let now = pool
                    .read_pages_sync(compute.as_ref(), &owned(pages))
                    .expect("read");
                assert!(was == now, "{device}: node {} reloaded wrong", node.id);
            }
        }
    }
);
