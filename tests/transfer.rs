//! P/D transfer: a request sent from N in {1, 2, 4, 8} sharded prefill ranks into one unsharded
//! decode pool must leave the decode pool byte-identical to what an unsharded prefill sends, and
//! to an independent expectation built from the reference bytes (every page at its registered
//! destination, the decode's cached prefix untouched, the indexer state of the whole sequence,
//! poison everywhere else). Covered: with and without the draft, shared-indexer layers,
//! decode-side cached prefixes, empty chunks and empty final chunks, coalesced and scattered
//! pages, both executors; completion bookkeeping and failure injection; validation errors. The
//! GPU runs the same requests (all ranks on one GPU, one stream each) and must match the CPU
//! reference byte for byte, for the kernel and the copy-engine executor.

mod common;

use kvshard::backend::cpu::CpuBackend;
use kvshard::backend::{Backend, Launch};
use kvshard::geometry::{CacheGeometry, ComponentLayout, LatentLayout, PoolGeometry, PAGE_SIZE};
use kvshard::pool::{BlockCopy, BlockCopyPlan, BlockSpace, DevicePool, PageSelection};
use kvshard::shard::Placement;
use kvshard::synth::{self, POISON};
use kvshard::transfer::{
    BackendTransport, ChunkEnd, ChunkResult, ChunkStatus, ComponentBytes, CopyMethod,
    DescriptorBatch, Finished, Outcome, PoolLayout, Receiver, Registration, Sender, Transport,
};
use kvshard::{Error, Result};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

const LAUNCH: Launch = Launch {
    ctas: 16,
    threads: 256,
};
const METHODS: [CopyMethod; 3] = [
    CopyMethod::Kernel(LAUNCH),
    CopyMethod::CopyEngine,
    CopyMethod::Blocks(LAUNCH),
];
const SHARDS: [u32; 4] = [1, 2, 4, 8];
/// Pages of the decode pool.
const DECODE_PAGES: u64 = 40;
const REQUEST: u64 = 42;

/// One request to send.
#[derive(Debug, Clone)]
struct Case {
    name: &'static str,
    geometry: CacheGeometry,
    /// Prefill chunk ends in tokens; the last one is the sequence length.
    chunk_ends: Vec<usize>,
    /// Pages the decode already holds.
    prefix_pages: usize,
    /// Pages handed out in order on both sides (runs coalesce) rather than shuffled.
    contiguous: bool,
}

impl Case {
    fn tokens(&self) -> usize {
        *self.chunk_ends.last().unwrap()
    }

    fn pages(&self) -> usize {
        self.tokens().div_ceil(PAGE_SIZE)
    }
}

fn draft_shared() -> CacheGeometry {
    CacheGeometry::with_draft(PoolGeometry::with_indexer_layers(
        LatentLayout::Fp8Trtllm,
        vec![true, false, true],
    ))
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "draft + shared-indexer layers, chunk ends inside pages",
            geometry: draft_shared(),
            chunk_ends: vec![300, 700, 1000],
            prefix_pages: 0,
            contiguous: false,
        },
        Case {
            name: "target only, coalescing pages",
            geometry: CacheGeometry::target_only(PoolGeometry::new(LatentLayout::Fp8Trtllm, 2)),
            chunk_ends: vec![512, 1000],
            prefix_pages: 0,
            contiguous: true,
        },
        Case {
            name: "decode-cached prefix of 5 pages, a chunk inside it",
            geometry: draft_shared(),
            chunk_ends: vec![200, 600, 1000],
            prefix_pages: 5,
            contiguous: false,
        },
        Case {
            name: "no indexer state, final chunk of one page",
            geometry: CacheGeometry::target_only(PoolGeometry::with_indexer_layers(
                LatentLayout::Fp8Scaled,
                vec![false, false],
            )),
            chunk_ends: vec![960, 1000],
            prefix_pages: 0,
            contiguous: true,
        },
        Case {
            name: "three-page request, bf16 rows, one chunk",
            geometry: CacheGeometry::with_draft(PoolGeometry::new(LatentLayout::Bf16, 2)),
            chunk_ends: vec![150],
            prefix_pages: 0,
            contiguous: false,
        },
        Case {
            name: "cached prefix, page-aligned chunks, coalescing",
            geometry: CacheGeometry::with_draft(PoolGeometry::new(LatentLayout::Fp8Trtllm, 1)),
            chunk_ends: vec![512, 1024],
            prefix_pages: 3,
            contiguous: true,
        },
    ]
}

/// Local pages per prefill rank: room for the rank's share of the sequence and a few more.
fn rank_pages(case: &Case, n: u32) -> u64 {
    case.pages().div_ceil(n as usize) as u64 + 4
}

/// The logical page of every position on `n` ranks of `rank_pages` pages (DOMAIN.md section 3):
/// position j is owned by `(start + j) % n` and takes that owner's next free local page, from
/// a free list in order or shuffled.
fn prefill_pages(
    rng: &mut StdRng,
    n: u32,
    rank_pages: u64,
    pages: usize,
    contiguous: bool,
) -> Vec<u64> {
    let start = rng.random_range(0..n);
    let free: Vec<Vec<u64>> = (0..n)
        .map(|_| {
            let mut v: Vec<u64> = (1..rank_pages).collect();
            if !contiguous {
                v.shuffle(rng);
            }
            v
        })
        .collect();
    let mut next = vec![0usize; n as usize];
    (0..pages)
        .map(|j| {
            let owner = (start + j as u32) % n;
            let local = free[owner as usize][next[owner as usize]];
            next[owner as usize] += 1;
            local * u64::from(n) + u64::from(owner)
        })
        .collect()
}

/// The decode page of every position: consecutive, or distinct random pages of the pool.
fn decode_pages(rng: &mut StdRng, pages: usize, contiguous: bool) -> Vec<u64> {
    if contiguous {
        (3..3 + pages as u64).collect()
    } else {
        let mut v: Vec<u64> = (1..DECODE_PAGES).collect();
        v.shuffle(rng);
        v.truncate(pages);
        v
    }
}

fn registration(case: &Case, dec: &[u64], decode: &DevicePool) -> Registration {
    Registration {
        request: REQUEST,
        layout: PoolLayout::of(decode),
        prefix_pages: case.prefix_pages,
        pages: dec[case.prefix_pages..].to_vec(),
        state_pages: dec.to_vec(),
    }
}

/// Offset of block (component `c`, `layer`, `page`) in a snapshot of a `pages`-page pool.
fn block_offset(
    components: &[ComponentLayout],
    pages: u64,
    c: usize,
    layer: usize,
    page: u64,
) -> usize {
    let before: usize = components[..c]
        .iter()
        .map(|x| x.layers() * pages as usize * x.block_bytes)
        .sum();
    before + (layer * pages as usize + page as usize) * components[c].block_bytes
}

/// Where two snapshots of a `pages`-page pool first differ, if they do.
fn difference(components: &[ComponentLayout], pages: u64, a: &[u8], b: &[u8]) -> Option<String> {
    if a.len() != b.len() {
        return Some(format!("lengths {} and {}", a.len(), b.len()));
    }
    let at = a.iter().zip(b).position(|(x, y)| x != y)?;
    for (c, comp) in components.iter().enumerate() {
        for layer in 0..comp.layers() {
            for page in 0..pages {
                let start = block_offset(components, pages, c, layer, page);
                if (start..start + comp.block_bytes).contains(&at) {
                    return Some(format!(
                        "{} layer {layer} page {page}, byte {}",
                        comp.component,
                        at - start
                    ));
                }
            }
        }
    }
    Some(format!("byte {at}"))
}

/// Writes `data` into block (`c`, `layer`, `page`) of a pool kvshard allocated.
fn write_block<B: Backend>(
    b: &B,
    pool: &DevicePool,
    c: usize,
    layer: usize,
    page: u64,
    data: &[u8],
) {
    let storage = pool.storage().unwrap();
    let offset = pool.block_addr(c, layer, page).unwrap() - storage.addr();
    b.write(storage, offset as usize, data).unwrap();
}

/// A decode pool: poison, except the latent blocks of the cached prefix, which hold bytes of
/// their own (a transfer must leave them alone).
fn decode_pool<B: Backend>(b: &B, case: &Case, dec: &[u64], seed: u64) -> DevicePool {
    let pool =
        DevicePool::allocate(b, &case.geometry, Placement::unsharded(), 0, DECODE_PAGES).unwrap();
    pool.fill(b, POISON).unwrap();
    let mut rng = StdRng::seed_from_u64(seed);
    for (c, comp) in pool.components().iter().enumerate() {
        if comp.component.is_indexer() {
            continue;
        }
        for layer in 0..comp.layers() {
            for &page in &dec[..case.prefix_pages] {
                write_block(
                    b,
                    &pool,
                    c,
                    layer,
                    page,
                    &synth::bytes(&mut rng, comp.block_bytes),
                );
            }
        }
    }
    // The ranks write on streams of their own: the poison must have landed first.
    b.synchronize().unwrap();
    pool
}

/// What the decode pool must hold afterwards, computed from the reference bytes alone: latent
/// blocks of positions after the prefix and indexer blocks of every position at their decode
/// pages, everything else as it was.
fn expected(
    case: &Case,
    before: &[u8],
    reference: &[u8],
    reference_pages: u64,
    src: &[u64],
    dec: &[u64],
) -> Vec<u8> {
    let components = case.geometry.components();
    let mut out = before.to_vec();
    for (j, (&s, &d)) in src.iter().zip(dec).enumerate() {
        for (c, comp) in components.iter().enumerate() {
            if !comp.component.is_indexer() && j < case.prefix_pages {
                continue;
            }
            for layer in 0..comp.layers() {
                let from = block_offset(&components, reference_pages, c, layer, s);
                let to = block_offset(&components, DECODE_PAGES, c, layer, d);
                out[to..to + comp.block_bytes]
                    .copy_from_slice(&reference[from..from + comp.block_bytes]);
            }
        }
    }
    out
}

/// Bytes rank `rank` of `n` must move: its positions after the prefix for latent components,
/// its positions from 0 for indexer ones.
fn owed_bytes(case: &Case, src: &[u64], n: u32, rank: u32) -> ComponentBytes {
    let mut out = ComponentBytes::default();
    for comp in case.geometry.components() {
        let first = if comp.component.is_indexer() {
            0
        } else {
            case.prefix_pages
        };
        let owned = src[first..]
            .iter()
            .filter(|&&p| p % u64::from(n) == u64::from(rank))
            .count();
        out.add(
            comp.component,
            (owned * comp.layers() * comp.block_bytes) as u64,
        );
    }
    out
}

/// What sending one request produced.
struct Sent {
    finished: Finished,
    statuses: Vec<ChunkStatus>,
    rank_bytes: Vec<ComponentBytes>,
}

/// Sends every chunk of `case` from every rank in `ranks` (a random rank order per chunk) into
/// `decode`, delivering each status to a receiver; checks the request finishes exactly with
/// the last status and leaves nothing pending anywhere.
fn send_request<B: Backend>(
    ranks: &[(&B, &DevicePool)],
    decode: &DevicePool,
    method: CopyMethod,
    case: &Case,
    src: &[u64],
    reg: &Registration,
    rng: &mut StdRng,
) -> Sent {
    let n = ranks.len() as u32;
    let mut transports: Vec<_> = ranks
        .iter()
        .map(|(b, _)| BackendTransport::new(*b, method))
        .collect();
    let mut senders: Vec<_> = ranks.iter().map(|(_, pool)| Sender::new(pool)).collect();
    let mut receiver = Receiver::new();
    receiver.register(reg.clone(), n).unwrap();
    for s in &mut senders {
        s.open(reg.clone()).unwrap();
    }
    let mut statuses = Vec::new();
    let mut finished = None;
    for (i, &end) in case.chunk_ends.iter().enumerate() {
        let end = if i + 1 == case.chunk_ends.len() {
            ChunkEnd::Final(end)
        } else {
            ChunkEnd::Partial(end)
        };
        let tokens = match end {
            ChunkEnd::Partial(t) | ChunkEnd::Final(t) => t,
        };
        // The prefill page table holds the pages of the tokens prefilled so far.
        let table = &src[..tokens.div_ceil(PAGE_SIZE)];
        let mut order: Vec<usize> = (0..ranks.len()).collect();
        order.shuffle(rng);
        for r in order {
            let status = senders[r]
                .send(&mut transports[r], decode, REQUEST, table, end)
                .unwrap();
            assert!(
                matches!(status.result, ChunkResult::Sent { .. }),
                "{status}"
            );
            assert!(
                finished.is_none(),
                "finished before every rank reported: {status}"
            );
            statuses.push(status.clone());
            finished = receiver.receive(status).unwrap();
        }
    }
    let finished = finished.expect("finished with the last status");
    assert_eq!(receiver.pending_requests(), 0);
    assert!(senders.iter().all(|s| s.pending_requests() == 0));
    Sent {
        finished,
        statuses,
        rank_bytes: senders.iter().map(Sender::bytes_sent).collect(),
    }
}

/// One case on one backend: decode snapshots after an N-rank send and after an unsharded send
/// of the same reference bytes, and the expectation.
struct Run {
    sharded: Vec<u8>,
    unsharded: Vec<u8>,
    expected: Vec<u8>,
    sent: Sent,
    src: Vec<u64>,
}

fn run_case<B: Backend>(
    base: &B,
    stream: &dyn Fn() -> B,
    case: &Case,
    n: u32,
    method: CopyMethod,
    seed: u64,
) -> Run {
    let mut rng = StdRng::seed_from_u64(seed);
    let g = &case.geometry;
    let placement = Placement::new(n).unwrap();
    let per_rank = rank_pages(case, n);
    let src = prefill_pages(&mut rng, n, per_rank, case.pages(), case.contiguous);
    let dec = decode_pages(&mut rng, case.pages(), case.contiguous);

    // The reference: logical page l at page l of one unsharded pool, random bytes. It is also
    // the pool of the unsharded prefill.
    let reference_pages = placement.logical_pages(per_rank);
    let reference =
        DevicePool::allocate(base, g, Placement::unsharded(), 0, reference_pages).unwrap();
    let storage = reference.storage().unwrap();
    base.write(storage, 0, &synth::bytes(&mut rng, storage.len()))
        .unwrap();

    // Prefill ranks: garbage everywhere, the reference bytes at their owned pages.
    let backends: Vec<B> = (0..n).map(|_| stream()).collect();
    let ids: Vec<i64> = src.iter().map(|&p| p as i64).collect();
    let pools: Vec<DevicePool> = backends
        .iter()
        .enumerate()
        .map(|(r, b)| {
            let pool = DevicePool::allocate(b, g, placement, r as u32, per_rank).unwrap();
            let storage = pool.storage().unwrap();
            b.write(storage, 0, &synth::bytes(&mut rng, storage.len()))
                .unwrap();
            let plan = BlockCopyPlan::new(
                &reference,
                PageSelection::Local(ids.clone()),
                &pool,
                PageSelection::Logical {
                    ids: ids.clone(),
                    placement,
                    rank: r as u32,
                },
                ids.len(),
            )
            .unwrap();
            BlockCopy::prepare(b, &plan, &reference, &pool)
                .unwrap()
                .run(b, LAUNCH)
                .unwrap();
            b.synchronize().unwrap();
            pool
        })
        .collect();

    let prefix_seed = rng.random();
    let sharded_decode = decode_pool(base, case, &dec, prefix_seed);
    let before = sharded_decode.snapshot(base).unwrap();
    let reg = registration(case, &dec, &sharded_decode);
    let ranks: Vec<(&B, &DevicePool)> = backends.iter().zip(&pools).collect();
    let sent = send_request(&ranks, &sharded_decode, method, case, &src, &reg, &mut rng);

    let unsharded_decode = decode_pool(base, case, &dec, prefix_seed);
    let solo = stream();
    send_request(
        &[(&solo, &reference)],
        &unsharded_decode,
        method,
        case,
        &src,
        &reg,
        &mut rng,
    );

    Run {
        sharded: sharded_decode.snapshot(base).unwrap(),
        unsharded: unsharded_decode.snapshot(base).unwrap(),
        expected: expected(
            case,
            &before,
            &reference.snapshot(base).unwrap(),
            reference_pages,
            &src,
            &dec,
        ),
        sent,
        src,
    }
}

fn check_run(case: &Case, n: u32, method: CopyMethod, run: &Run) {
    let what = format!("{} N={n} {method:?}", case.name);
    let components = case.geometry.components();
    if let Some(at) = difference(&components, DECODE_PAGES, &run.unsharded, &run.expected) {
        panic!("{what}: the unsharded send differs from the expectation at {at}");
    }
    if let Some(at) = difference(&components, DECODE_PAGES, &run.sharded, &run.unsharded) {
        panic!("{what}: the sharded send differs from the unsharded one at {at}");
    }
    let f = &run.sent.finished;
    assert!(f.is_completed(), "{what}: {:?}", f.outcome);
    assert_eq!(f.request(), REQUEST);
    for rank in 0..n {
        let owed = owed_bytes(case, &run.src, n, rank);
        assert_eq!(f.bytes[rank as usize], owed, "{what}: bytes of rank {rank}");
        assert_eq!(
            run.sent.rank_bytes[rank as usize], owed,
            "{what}: sender bytes of rank {rank}"
        );
    }
    assert_eq!(
        f.total_bytes(),
        owed_bytes(case, &run.src, 1, 0),
        "{what}: the ranks' bytes add up to an unsharded send"
    );
    // One status per rank per chunk, empty chunks included.
    assert_eq!(
        run.sent.statuses.len(),
        n as usize * case.chunk_ends.len(),
        "{what}"
    );
}

#[test]
fn cpu_sharded_sends_match_an_unsharded_prefill() {
    let mut rng = common::rng("cpu_sharded_sends_match_an_unsharded_prefill");
    let base = CpuBackend::new();
    for case in cases() {
        for n in SHARDS {
            for method in METHODS {
                let run = run_case(&base, &|| base.new_stream(), &case, n, method, rng.random());
                check_run(&case, n, method, &run);
            }
        }
    }
}

#[test]
fn ranks_owning_nothing_still_send_an_empty_final_chunk() {
    let mut rng = common::rng("ranks_owning_nothing_still_send_an_empty_final_chunk");
    let base = CpuBackend::new();
    let all = cases();
    // One page in the final chunk and no state: 7 of 8 ranks have nothing to send in it.
    let one_page = &all[3];
    let run = run_case(
        &base,
        &|| base.new_stream(),
        one_page,
        8,
        CopyMethod::CopyEngine,
        rng.random(),
    );
    check_run(one_page, 8, CopyMethod::CopyEngine, &run);
    let empty_finals = run
        .sent
        .statuses
        .iter()
        .filter(|s| {
            s.is_terminal()
                && s.result
                    == ChunkResult::Sent {
                        bytes: ComponentBytes::default(),
                        last: true,
                    }
        })
        .count();
    assert_eq!(empty_finals, 7);
    // Three pages with their state: 5 of 8 ranks own nothing of the whole request.
    let short = &all[4];
    let run = run_case(
        &base,
        &|| base.new_stream(),
        short,
        8,
        CopyMethod::CopyEngine,
        rng.random(),
    );
    check_run(short, 8, CopyMethod::CopyEngine, &run);
    let idle = run
        .sent
        .finished
        .bytes
        .iter()
        .filter(|b| b.total() == 0)
        .count();
    assert_eq!(idle, 5);
    // A chunk that ends inside the decode's cached prefix sends nothing on any rank.
    let cached = &all[2];
    let run = run_case(
        &base,
        &|| base.new_stream(),
        cached,
        4,
        CopyMethod::CopyEngine,
        rng.random(),
    );
    check_run(cached, 4, CopyMethod::CopyEngine, &run);
    let first: Vec<_> = run.sent.statuses.iter().filter(|s| s.chunk == 0).collect();
    assert_eq!(first.len(), 4);
    assert!(first.iter().all(|s| s.result
        == ChunkResult::Sent {
            bytes: ComponentBytes::default(),
            last: false
        }));
}

/// A transport that fails its `fail_on`-th submission (counting from 1), and records whether
/// it was waited for after that (a sender must drain before it reports the failure).
struct Failing<T> {
    inner: T,
    fail_on: usize,
    submitted: usize,
    drained_after_failure: bool,
}

impl<T: Transport> Transport for Failing<T> {
    fn submit(&mut self, batch: &DescriptorBatch<'_>) -> Result<()> {
        self.submitted += 1;
        if self.submitted == self.fail_on {
            return Err(Error::Transfer {
                request: batch.request(),
                reason: format!("injected failure of submission {}", self.submitted),
            });
        }
        self.inner.submit(batch)
    }

    fn wait(&mut self) -> Result<()> {
        self.drained_after_failure |= self.submitted >= self.fail_on && self.fail_on > 0;
        self.inner.wait()
    }
}

/// Sends a 3-chunk request from 4 ranks, rank 2's transport failing its second chunk. The
/// other ranks either go on sending (`abort` false) or are told to abort once the decode side
/// sees the failure. Either way the request ends failed on both sides, every status is
/// accepted, and nothing stays pending.
fn fail_mid_request(abort: bool, seed: u64) {
    let case = &cases()[0];
    let n = 4u32;
    let b = CpuBackend::new();
    let mut rng = StdRng::seed_from_u64(seed);
    let placement = Placement::new(n).unwrap();
    let per_rank = rank_pages(case, n);
    let src = prefill_pages(&mut rng, n, per_rank, case.pages(), false);
    let dec = decode_pages(&mut rng, case.pages(), false);
    let pools: Vec<DevicePool> = (0..n)
        .map(|r| DevicePool::allocate(&b, &case.geometry, placement, r, per_rank).unwrap())
        .collect();
    let decode = decode_pool(&b, case, &dec, 1);
    let reg = registration(case, &dec, &decode);
    let mut senders: Vec<_> = pools.iter().map(Sender::new).collect();
    let mut transports: Vec<Failing<_>> = (0..n)
        .map(|r| Failing {
            inner: BackendTransport::new(&b, CopyMethod::CopyEngine),
            fail_on: if r == 2 { 2 } else { 0 },
            submitted: 0,
            drained_after_failure: false,
        })
        .collect();
    let mut receiver = Receiver::new();
    receiver.register(reg.clone(), n).unwrap();
    for s in &mut senders {
        s.open(reg.clone()).unwrap();
    }
    let mut delivered = 0;
    // Whether the decode side has seen the failure (and, with `abort`, the control plane told
    // the other ranks).
    let mut decode_failed = false;
    let mut finished = None;
    let mut deliver = |receiver: &mut Receiver, status: ChunkStatus| {
        assert!(
            finished.is_none(),
            "a status after the request finished: {status}"
        );
        delivered += 1;
        finished = receiver.receive(status).unwrap();
    };
    for (i, &tokens) in case.chunk_ends.iter().enumerate() {
        let last = i + 1 == case.chunk_ends.len();
        let end = if last {
            ChunkEnd::Final(tokens)
        } else {
            ChunkEnd::Partial(tokens)
        };
        let table = &src[..tokens.div_ceil(PAGE_SIZE)];
        for r in 0..n as usize {
            if abort && decode_failed {
                // The decode side saw the failure and the control plane tells the rest to stop.
                if let Ok(status) = senders[r].abort(REQUEST, "the decode side failed the request")
                {
                    deliver(&mut receiver, status);
                }
                continue;
            }
            match senders[r].send(&mut transports[r], &decode, REQUEST, table, end) {
                Ok(status) => {
                    let failed = matches!(status.result, ChunkResult::Failed { .. });
                    assert_eq!(failed, r == 2 && i == 1, "{status}");
                    if failed {
                        assert!(status.is_terminal());
                        assert_eq!(
                            senders[r].pending_requests(),
                            0,
                            "failed on the prefill side at once"
                        );
                    }
                    deliver(&mut receiver, status);
                    if failed {
                        let p = receiver.progress(REQUEST).unwrap();
                        assert!(p.failed && p.ranks_done < n, "{p:?}");
                        decode_failed = true;
                    }
                }
                Err(e) => {
                    // Only the failed rank refuses to go on with the request.
                    assert!(r == 2 && i == 2, "{e}");
                    assert!(e.to_string().contains("not open on prefill rank 2"), "{e}");
                }
            }
        }
    }
    let finished = finished.expect("finished once every rank reported its last status");
    assert_eq!(
        finished.registration, reg,
        "the pages are handed back to be freed"
    );
    let Outcome::Failed(failures) = &finished.outcome else {
        panic!("{:?}", finished.outcome);
    };
    assert_eq!((failures[0].rank, failures[0].chunk), (2, 1));
    assert!(
        failures[0]
            .reason
            .contains("injected failure of submission 2"),
        "{}",
        failures[0].reason
    );
    if abort {
        // Rank 3 (its chunk 1 came after rank 2's failure), then ranks 0 and 1 (chunk 2) were
        // aborted.
        assert_eq!(failures.len(), 4, "{failures:?}");
        assert!(failures[1..]
            .iter()
            .all(|f| f.reason.starts_with("aborted: ")));
        assert_eq!(delivered, 4 + 4 + 2);
    } else {
        assert_eq!(failures.len(), 1);
        assert_eq!(delivered, 4 + 4 + 3);
    }
    assert_eq!(receiver.pending_requests(), 0);
    assert!(senders.iter().all(|s| s.pending_requests() == 0));
    assert!(transports[2].drained_after_failure);
}

#[test]
fn a_failed_chunk_fails_the_request_on_both_sides_and_leaks_nothing() {
    let mut rng = common::rng("a_failed_chunk_fails_the_request_on_both_sides_and_leaks_nothing");
    fail_mid_request(false, rng.random());
    fail_mid_request(true, rng.random());
}

#[test]
fn invalid_requests_fail_before_any_byte_moves() {
    let b = CpuBackend::new();
    let case = &cases()[0];
    let n = 2u32;
    let placement = Placement::new(n).unwrap();
    let pools: Vec<DevicePool> = (0..n)
        .map(|r| DevicePool::allocate(&b, &case.geometry, placement, r, 20).unwrap())
        .collect();
    let src: Vec<u64> = (0..case.pages() as u64).map(|p| 2 + p).collect();
    let dec: Vec<u64> = (1..=case.pages() as u64).collect();
    let decode = decode_pool(&b, case, &dec, 1);
    let before = decode.snapshot(&b).unwrap();
    let good = registration(case, &dec, &decode);

    // A destination page outside the decode pool, in the first chunk's pages.
    let mut far = good.clone();
    far.pages[3] = DECODE_PAGES + 7;
    // The indexer state registered for one page too few.
    let mut state = good.clone();
    state.state_pages.pop();
    // The decode registered its indexer blocks with another stride.
    let mut stride = good.clone();
    stride.layout.page_strides[1] += 64;
    // The decode runs no draft.
    let mut no_draft = good.clone();
    no_draft.layout = PoolLayout::packed(
        CacheGeometry::target_only(case.geometry.target.clone()),
        DECODE_PAGES,
    );
    let expectations = [
        (far, 0, "request 42: destination page 47 at position 3 out of range (the decode pool holds 40 pages)"),
        (stride, 0, "request 42: packed page stride mismatch for target indexer: prefill 8448 B, decode 8512 B"),
        (no_draft, 0, "request 42: prefill vs decode: draft pool present: expected true, got false"),
        // Last: its first two chunks go through.
        (state, 2, "request 42: state page count mismatch: the prefill sends 16 state pages (positions 0..16), the decode registered 15"),
    ];
    for (reg, failing_chunk, message) in expectations {
        let mut receiver = Receiver::new();
        receiver.register(reg.clone(), n).unwrap();
        let mut senders: Vec<_> = pools.iter().map(Sender::new).collect();
        let mut finished = None;
        for (r, sender) in senders.iter_mut().enumerate() {
            sender.open(reg.clone()).unwrap();
            let mut transport = BackendTransport::new(&b, CopyMethod::CopyEngine);
            for (i, &tokens) in case.chunk_ends.iter().enumerate() {
                let end = if i + 1 == case.chunk_ends.len() {
                    ChunkEnd::Final(tokens)
                } else {
                    ChunkEnd::Partial(tokens)
                };
                let status = sender
                    .send(&mut transport, &decode, REQUEST, &src, end)
                    .unwrap();
                let ChunkResult::Failed { reason } = &status.result else {
                    assert!(i < failing_chunk, "rank {r} chunk {i}: {status}");
                    finished = receiver.receive(status).unwrap();
                    continue;
                };
                // Every rank refuses the same chunk: it checks all pages, not only its own.
                assert_eq!(i, failing_chunk, "rank {r}: {reason}");
                assert!(
                    reason.contains(message),
                    "rank {r}: {reason}\nexpected: {message}"
                );
                finished = receiver.receive(status).unwrap();
                break;
            }
            assert_eq!(sender.pending_requests(), 0);
        }
        let finished = finished.expect("finished");
        assert!(matches!(&finished.outcome, Outcome::Failed(f) if f.len() == 2));
        assert_eq!(receiver.pending_requests(), 0);
        if failing_chunk == 0 {
            assert!(
                decode.snapshot(&b).unwrap() == before,
                "{message}: bytes moved before the failure"
            );
        }
    }
}

fn sent(chunk: u32, bytes: u64, last: bool) -> ChunkStatus {
    let mut b = ComponentBytes::default();
    b.add(kvshard::geometry::Component::TargetLatent, bytes);
    ChunkStatus {
        request: REQUEST,
        rank: 1,
        chunk,
        result: ChunkResult::Sent { bytes: b, last },
    }
}

#[test]
fn the_receiver_refuses_unknown_duplicate_and_out_of_order_statuses() {
    let b = CpuBackend::new();
    let case = &cases()[1];
    let decode = decode_pool(&b, case, &[1, 2], 0);
    let reg = registration(case, &(1..=16).collect::<Vec<_>>(), &decode);
    let mut rx = Receiver::new();
    let err = |r: Result<Option<Finished>>| r.unwrap_err().to_string();
    assert!(err(rx.receive(sent(0, 1, false)))
        .contains("request 42: status of chunk 0 from prefill rank 1: not registered"));
    assert!(rx
        .register(reg.clone(), 0)
        .unwrap_err()
        .to_string()
        .contains("at least one prefill rank"));
    rx.register(reg.clone(), 2).unwrap();
    assert!(rx
        .register(reg.clone(), 2)
        .unwrap_err()
        .to_string()
        .contains("already registered"));

    let e = err(rx.receive(sent(1, 1, false)));
    assert!(
        e.contains("out-of-order status of chunk 1 from prefill rank 1 (chunk 0 expected)"),
        "{e}"
    );
    assert!(rx.receive(sent(0, 10, false)).unwrap().is_none());
    let e = err(rx.receive(sent(0, 10, false)));
    assert!(
        e.contains("duplicate status of chunk 0 from prefill rank 1 (chunk 1 expected)"),
        "{e}"
    );
    let mut stranger = sent(1, 1, false);
    stranger.rank = 2;
    assert!(err(rx.receive(stranger))
        .contains("status from prefill rank 2, but 2 ranks send the request"));
    assert!(
        rx.receive(sent(1, 5, true)).unwrap().is_none(),
        "rank 0 has not reported"
    );
    let e = err(rx.receive(sent(2, 1, true)));
    assert!(
        e.contains("status of chunk 2 from prefill rank 1 after its last status"),
        "{e}"
    );
    let p = rx.progress(REQUEST).unwrap();
    assert_eq!(
        (p.ranks, p.ranks_done, p.failed),
        (2, 1, false),
        "refused statuses change nothing"
    );

    let mut rank0 = sent(0, 7, true);
    rank0.rank = 0;
    let done = rx.receive(rank0).unwrap().expect("both ranks reported");
    assert!(done.is_completed());
    assert_eq!(
        done.bytes
            .iter()
            .map(ComponentBytes::total)
            .collect::<Vec<_>>(),
        vec![7, 15]
    );
    assert_eq!(rx.pending_requests(), 0);
    assert!(rx.progress(REQUEST).is_none());
    assert!(err(rx.receive(sent(2, 1, true))).contains("not registered"));

    // The prefill side refuses what it does not know, and opening twice.
    let pool = DevicePool::allocate(&b, &case.geometry, Placement::new(2).unwrap(), 1, 20).unwrap();
    let mut tx = Sender::new(&pool);
    let mut t = BackendTransport::new(&b, CopyMethod::CopyEngine);
    let e = tx
        .send(&mut t, &decode, REQUEST, &[], ChunkEnd::Final(0))
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("request 42: not open on prefill rank 1"),
        "{e}"
    );
    assert!(tx.abort(REQUEST, "why").is_err());
    tx.open(reg.clone()).unwrap();
    assert!(tx
        .open(reg)
        .unwrap_err()
        .to_string()
        .contains("already open on prefill rank 1"));
    let aborted = tx.abort(REQUEST, "cancelled").unwrap();
    assert_eq!(
        aborted.result,
        ChunkResult::Failed {
            reason: "aborted: cancelled".into()
        }
    );
    assert_eq!(tx.pending_requests(), 0);
}

#[test]
fn gpu_sends_match_cpu_byte_for_byte() {
    let Some(gpu) = common::cuda("gpu_sends_match_cpu_byte_for_byte") else {
        return;
    };
    let mut rng = common::rng("gpu_sends_match_cpu_byte_for_byte");
    let cpu = CpuBackend::new();
    let device = gpu.gpu().clone();
    let stream = || kvshard::backend::cuda::CudaBackend::new(device.clone()).unwrap();
    for case in cases() {
        for n in SHARDS {
            for method in METHODS {
                let seed = rng.random();
                let reference = run_case(&cpu, &|| cpu.new_stream(), &case, n, method, seed);
                check_run(&case, n, method, &reference);
                let run = run_case(&gpu, &stream, &case, n, method, seed);
                check_run(&case, n, method, &run);
                let components = case.geometry.components();
                if let Some(at) =
                    difference(&components, DECODE_PAGES, &run.sharded, &reference.sharded)
                {
                    panic!(
                        "{} N={n} {method:?}: the GPU decode pool differs from the CPU one at {at}",
                        case.name
                    );
                }
                assert_eq!(run.sent.finished, reference.sent.finished);
            }
        }
    }
}
