//! The CP prefill data path: gather plans, the scratch page table kernel, the pack of send
//! lists, a one-GPU all-gather emulation, the scratch budget, batch admission, the eviction
//! helper and the allocator's release order, each against a straightforward reference at N in
//! {1, 2, 3, 4, 8} (the pressure demo's tests are the applications', cli/tests/demo.rs). What
//! runs on a device runs from one body on the CPU twin (`cpu_*`) and on the GPU (`gpu_*`,
//! SKIPPED without one), which must also make the same bytes as the twin.

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;

use common::synth::{self, POISON};
use kvshard::abi;
use kvshard::backend::{i64s_from_bytes, upload_i64s_sync, Backend, Launch};
use kvshard::backend::{KernelFamily, MemoryKind};
use kvshard::copy::{BlockCopy, BlockSpace, ScratchTable, Staging};
use kvshard::geometry::{CacheGeometry, LatentLayout, PoolGeometry};
use kvshard::hicache::TransferPlan;
use kvshard::index::{LocalPage, LogicalPage, ModelLayer, StoredLayer};
use kvshard::pool::{Budget, BudgetRequest, DevicePool};
use kvshard::shard::{
    evict_until_allocatable, Admission, AdmissionLimits, AllocRequest, Allocation, Candidate,
    ChainStart, Decision, Deferral, EvictionStall, GatherPlan, GatherRequest, Placement,
    ScratchLayout, ShardAllocator,
};
use kvshard::transfer::{ChunkRange, PoolLayout, PrefillRank, Registration, SendPlan};
use kvshard::Error;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const SHARDS: [u32; 5] = [1, 2, 3, 4, 8];

fn lp(pages: &[u64]) -> Vec<LogicalPage> {
    pages.iter().map(|&p| LogicalPage(p)).collect()
}

/// A small DSA geometry: 3 target layers (the second shares its indexer) and the MTP draft.
fn small() -> CacheGeometry {
    CacheGeometry::with_draft(PoolGeometry::with_indexer_layers(
        LatentLayout::Fp8Trtllm,
        vec![true, false, true],
    ))
}

/// The production geometry: 61 target layers (every fourth shares its indexer) and the draft.
fn production() -> CacheGeometry {
    CacheGeometry::with_draft(PoolGeometry::with_indexer_layers(
        LatentLayout::Fp8Trtllm,
        (0..61).map(|i| i % 4 != 3).collect(),
    ))
}

// ---------------------------------------------------------------------------------------------
// Release order: a straightforward model of the allocator, and descriptor counts after churn.
// ---------------------------------------------------------------------------------------------

/// The rotated-owner allocator written out step by step: per class a free stack (next page out
/// is the last) and, with `sorted`, release lists merged and sorted, every class at once, when a
/// class runs short of what an allocation takes from it (SGLang's `merge_and_sort_free`). Without `sorted` a free pushes pages
/// straight back onto the stack, as kvshard did before the release order (the "before" of the
/// descriptor counts).
struct RefAlloc {
    n: u32,
    sorted: bool,
    free: Vec<Vec<u64>>,
    release: Vec<Vec<u64>>,
    live: BTreeSet<u64>,
}

impl RefAlloc {
    fn new(n: u32, ppr: u64, sorted: bool) -> Self {
        let n64 = u64::from(n);
        Self {
            n,
            sorted,
            free: (0..n64)
                .map(|c| (1..ppr).rev().map(|l| l * n64 + c).collect())
                .collect(),
            release: vec![Vec::new(); n as usize],
            live: BTreeSet::new(),
        }
    }

    fn free_of(&self, c: usize) -> usize {
        self.free[c].len() + self.release[c].len()
    }

    fn merge(&mut self, c: usize) {
        let released = std::mem::take(&mut self.release[c]);
        if released.is_empty() {
            return;
        }
        self.free[c].extend(released);
        self.free[c].sort_by(|a, b| b.cmp(a));
    }

    /// SGLang's `merge_and_sort_free` under `need_sort`: every class merges once any class's
    /// stack is short of what the call takes from it.
    fn merge_if_short(&mut self, needs: &[usize]) {
        if self.sorted && (0..self.n as usize).any(|c| self.free[c].len() < needs[c]) {
            for c in 0..self.n as usize {
                self.merge(c);
            }
        }
    }

    fn shortage(&self, needs: &[usize]) -> Option<Error> {
        (0..self.n as usize).find_map(|c| {
            (needs[c] > self.free_of(c)).then(|| Error::Exhausted {
                owner: c as u32,
                needed: needs[c],
                free: self.free_of(c),
            })
        })
    }

    fn alloc_batch(&mut self, reqs: &[AllocRequest]) -> Result<Vec<Allocation>, Error> {
        let n = self.n as usize;
        let mut needs = vec![0usize; n];
        let mut plans = Vec::new();
        for r in reqs {
            let (start, first) = match r.chain {
                ChainStart::New => {
                    let left = |c: usize| self.free_of(c) as i64 - needs[c] as i64;
                    (
                        (0..n).fold(0, |b, c| if left(c) > left(b) { c } else { b }),
                        0,
                    )
                }
                ChainStart::Extend {
                    start_owner,
                    prefix_tokens,
                } => (start_owner as usize, prefix_tokens / 64),
            };
            for j in 0..r.pages {
                needs[(start + first + j) % n] += 1;
            }
            plans.push((start, first, r.pages));
        }
        if let Some(e) = self.shortage(&needs) {
            return Err(e);
        }
        self.merge_if_short(&needs);
        let mut out = Vec::new();
        for (start, first, pages) in plans {
            let pages: Vec<u64> = (0..pages)
                .map(|j| self.free[(start + first + j) % n].pop().unwrap())
                .collect();
            self.live.extend(&pages);
            out.push(Allocation {
                start_owner: start as u32,
                first_position: first,
                pages: lp(&pages),
            });
        }
        Ok(out)
    }

    fn alloc_matching(&mut self, pages: &[LogicalPage]) -> Result<Vec<LogicalPage>, Error> {
        let n = self.n as usize;
        let mut needs = vec![0usize; n];
        for p in pages {
            needs[(p.0 % n as u64) as usize] += 1;
        }
        if let Some(e) = self.shortage(&needs) {
            return Err(e);
        }
        self.merge_if_short(&needs);
        let out: Vec<u64> = pages
            .iter()
            .map(|p| self.free[(p.0 % n as u64) as usize].pop().unwrap())
            .collect();
        self.live.extend(&out);
        Ok(lp(&out))
    }

    fn free(&mut self, pages: &[LogicalPage]) {
        for p in pages {
            assert!(self.live.remove(&p.0), "model freed {} twice", p.0);
            let c = (p.0 % u64::from(self.n)) as usize;
            if self.sorted {
                self.release[c].push(p.0);
            } else {
                self.free[c].push(p.0);
            }
        }
    }
}

fn same_error(a: &Error, b: &Error) -> bool {
    match (a, b) {
        (
            Error::Exhausted {
                owner,
                needed,
                free,
            },
            Error::Exhausted {
                owner: o,
                needed: n,
                free: f,
            },
        ) => (owner, needed, free) == (o, n, f),
        _ => false,
    }
}

#[test]
fn release_order_matches_the_reference_at_every_shard_size() {
    let mut rng = common::rng("release_order_matches_the_reference_at_every_shard_size");
    for n in SHARDS {
        for _ in 0..40 {
            let ppr = rng.random_range(2..40u64);
            let mut a = ShardAllocator::new(Placement::new(n).unwrap(), ppr).unwrap();
            let mut m = RefAlloc::new(n, ppr, true);
            // Chains as (start owner, pages); loose pages from matching allocations.
            let mut chains: Vec<(u32, Vec<LogicalPage>)> = Vec::new();
            let mut loose: Vec<LogicalPage> = Vec::new();
            for _ in 0..60 {
                match rng.random_range(0..4) {
                    0 | 1 => {
                        let mut reqs = Vec::new();
                        let mut extended = Vec::new();
                        for _ in 0..rng.random_range(1..4) {
                            let pages = rng.random_range(0..12);
                            let pick = rng.random_range(0..chains.len() + 1);
                            match chains.get(pick) {
                                Some((start, held)) if !extended.contains(&pick) => {
                                    extended.push(pick);
                                    reqs.push(AllocRequest {
                                        chain: ChainStart::Extend {
                                            start_owner: *start,
                                            prefix_tokens: 64 * held.len(),
                                        },
                                        pages,
                                    });
                                }
                                _ => {
                                    extended.push(usize::MAX);
                                    reqs.push(AllocRequest {
                                        chain: ChainStart::New,
                                        pages,
                                    });
                                }
                            }
                        }
                        match (a.alloc_batch(&reqs), m.alloc_batch(&reqs)) {
                            (Ok(got), Ok(want)) => {
                                assert_eq!(got, want, "N={n}: batch {reqs:?}");
                                for (alloc, &pick) in got.into_iter().zip(&extended) {
                                    match chains.get_mut(pick) {
                                        Some((_, held)) => held.extend(alloc.pages),
                                        None => chains.push((alloc.start_owner, alloc.pages)),
                                    }
                                }
                            }
                            (Err(e), Err(f)) => assert!(same_error(&e, &f), "N={n}: {e} vs {f}"),
                            (got, want) => panic!("N={n}: {got:?} vs {want:?}"),
                        }
                    }
                    2 if !chains.is_empty() => {
                        // Free a chain's tail (as a radix tree evicts leaves), pages in a
                        // random order.
                        let i = rng.random_range(0..chains.len());
                        let keep = rng.random_range(0..=chains[i].1.len());
                        let mut tail = chains[i].1.split_off(keep);
                        for k in (1..tail.len()).rev() {
                            tail.swap(k, rng.random_range(0..=k));
                        }
                        a.free(&tail).unwrap();
                        m.free(&tail);
                        if chains[i].1.is_empty() {
                            chains.swap_remove(i);
                        }
                        if rng.random_bool(0.3) {
                            a.free(&loose).unwrap();
                            m.free(&loose);
                            loose.clear();
                        }
                    }
                    _ => {
                        let picks: Vec<LogicalPage> = (0..rng.random_range(0..6))
                            .map(|_| LogicalPage(u64::from(n) + rng.random_range(0..1000)))
                            .collect();
                        match (a.alloc_matching(&picks), m.alloc_matching(&picks)) {
                            (Ok(got), Ok(want)) => {
                                assert_eq!(got, want, "N={n}: matching {picks:?}");
                                loose.extend(got);
                            }
                            (Err(e), Err(f)) => assert!(same_error(&e, &f), "N={n}: {e} vs {f}"),
                            (got, want) => panic!("N={n}: {got:?} vs {want:?}"),
                        }
                    }
                }
                for c in 0..n {
                    assert_eq!(a.free_pages(c), m.free_of(c as usize), "N={n} class {c}");
                    assert_eq!(a.released_pages(c), m.release[c as usize].len());
                }
                let min = (0..n as usize).map(|c| m.free_of(c)).min().unwrap() as u64;
                assert_eq!(a.admission_capacity(), u64::from(n) * 64 * min);
            }
        }
    }
}

#[test]
fn a_failed_operation_merges_nothing() {
    let mut a = ShardAllocator::new(Placement::new(2).unwrap(), 4).unwrap();
    let chain = a
        .alloc(AllocRequest {
            chain: ChainStart::New,
            pages: 4,
        })
        .unwrap();
    a.free(&chain.pages).unwrap();
    let before = a.clone();
    // 4 pages of class 0 (3 free): exhausted, and the release lists stay as they were.
    assert!(matches!(
        a.alloc_matching(&lp(&[2, 4, 6, 8])),
        Err(Error::Exhausted { owner: 0, .. })
    ));
    assert!(a
        .alloc(AllocRequest {
            chain: ChainStart::Extend {
                start_owner: 0,
                prefix_tokens: 0
            },
            pages: 7
        })
        .is_err());
    assert_eq!(a, before);
    assert_eq!(a.released_pages(0), 2);
}

trait Policy {
    fn alloc_batch(&mut self, reqs: &[AllocRequest]) -> Vec<Allocation>;
    fn try_alloc(&mut self, reqs: &[AllocRequest]) -> Option<Vec<Allocation>>;
    fn free(&mut self, pages: &[LogicalPage]);
}

impl Policy for ShardAllocator {
    fn alloc_batch(&mut self, reqs: &[AllocRequest]) -> Vec<Allocation> {
        ShardAllocator::alloc_batch(self, reqs).unwrap()
    }
    fn try_alloc(&mut self, reqs: &[AllocRequest]) -> Option<Vec<Allocation>> {
        ShardAllocator::alloc_batch(self, reqs).ok()
    }
    fn free(&mut self, pages: &[LogicalPage]) {
        ShardAllocator::free(self, pages).unwrap()
    }
}

impl Policy for RefAlloc {
    fn alloc_batch(&mut self, reqs: &[AllocRequest]) -> Vec<Allocation> {
        RefAlloc::alloc_batch(self, reqs).unwrap()
    }
    fn try_alloc(&mut self, reqs: &[AllocRequest]) -> Option<Vec<Allocation>> {
        RefAlloc::alloc_batch(self, reqs).ok()
    }
    fn free(&mut self, pages: &[LogicalPage]) {
        RefAlloc::free(self, pages)
    }
}

type Live = Vec<(Vec<LogicalPage>, Vec<LogicalPage>, Vec<LogicalPage>)>;

/// Frees a random live request from the prefill, decode and host allocators.
fn free_one<P: Policy>(live: &mut Live, pools: &mut [P; 3], rng: &mut StdRng) {
    let i = rng.random_range(0..live.len());
    let (p, d, h) = live.swap_remove(i);
    pools[0].free(&p);
    pools[1].free(&d);
    pools[2].free(&h);
}

/// Average descriptors per P/D chunk (all ranks) and runs per HiCache transfer (all ranks)
/// after churn: requests of random sizes come and go (freed in random order); every 10 cycles
/// a 4,096-token request is allocated and planned (one final P/D chunk of the production
/// geometry into an unsharded decode pool whose allocator churns alike, and a HiCache backup
/// into a churned host pool), then freed.
fn churn_counts<P: Policy>(n: u32, make: impl Fn(u32, u64) -> P) -> (f64, f64) {
    let placement = Placement::new(n).unwrap();
    let (ppr, host_ppr) = (512u64, 2048u64);
    // Room for whatever the prefill group holds, plus a measurement request.
    let decode_pages = u64::from(n) * ppr + 128;
    let mut pools = [make(n, ppr), make(1, decode_pages), make(n, host_ppr)];
    let mut rng = StdRng::seed_from_u64(14);
    let mut live: Live = Vec::new();
    let new = |pages| AllocRequest {
        chain: ChainStart::New,
        pages,
    };
    let host_of = |a: &Allocation| AllocRequest {
        chain: ChainStart::Extend {
            start_owner: a.start_owner,
            prefix_tokens: 0,
        },
        pages: a.pages.len(),
    };
    let layout = PoolLayout::packed(production(), ppr);
    let (mut pd, mut hc, mut samples) = (0usize, 0usize, 0usize);
    for cycle in 0..600 {
        let sizes: Vec<usize> = (0..rng.random_range(1..=4))
            .map(|_| rng.random_range(2..=48))
            .collect();
        let reqs: Vec<AllocRequest> = sizes.iter().map(|&s| new(s)).collect();
        let p = loop {
            match pools[0].try_alloc(&reqs) {
                Some(p) => break p,
                None => free_one(&mut live, &mut pools, &mut rng),
            }
        };
        let d = pools[1].alloc_batch(&reqs);
        let h = pools[2].alloc_batch(&p.iter().map(host_of).collect::<Vec<_>>());
        for ((p, d), h) in p.into_iter().zip(d).zip(h) {
            live.push((p.pages, d.pages, h.pages));
        }
        while live.len() > 6 && rng.random_bool(0.5) {
            free_one(&mut live, &mut pools, &mut rng);
        }
        if cycle % 10 != 9 {
            continue;
        }
        let chain = loop {
            match pools[0].try_alloc(&[new(64)]) {
                Some(mut a) => break a.remove(0),
                None => free_one(&mut live, &mut pools, &mut rng),
            }
        };
        let dst = pools[1].alloc_batch(&[new(64)]).remove(0).pages;
        let host = pools[2].alloc_batch(&[host_of(&chain)]).remove(0).pages;
        let local: Vec<LocalPage> = dst.iter().map(|p| LocalPage(p.0)).collect();
        let registration = Registration {
            request: 1,
            layout: PoolLayout::packed(production(), decode_pages),
            prefix_pages: 0,
            pages: local.clone(),
            state_pages: local,
        };
        let chunk = ChunkRange {
            index: 0,
            start: 0,
            end: 64 * 64,
            last: true,
        };
        for rank in 0..n {
            let source = PrefillRank {
                placement,
                rank,
                layout: layout.clone(),
            };
            pd += SendPlan::new(&source, &chain.pages, &registration, chunk)
                .unwrap()
                .descriptor_count();
            hc += TransferPlan::new(placement, rank, &chain.pages, &host, ppr, host_ppr)
                .unwrap()
                .runs()
                .len();
        }
        samples += 1;
        pools[0].free(&chain.pages);
        pools[1].free(&dst);
        pools[2].free(&host);
    }
    (pd as f64 / samples as f64, hc as f64 / samples as f64)
}

/// The numbers of the report: the same churn through last-freed-first stacks (kvshard before
/// the release order, modelled by `RefAlloc` without sorting) and through the allocator.
#[test]
fn descriptor_counts_after_churn_before_and_after_the_release_order() {
    for n in [1, 2, 4, 8] {
        let before = churn_counts(n, |n, ppr| RefAlloc::new(n, ppr, false));
        let after = churn_counts(n, |n, ppr| {
            ShardAllocator::new(Placement::new(n).unwrap(), ppr).unwrap()
        });
        eprintln!(
            "N={n}: descriptors per P/D chunk {:.1} -> {:.1}, runs per HiCache transfer {:.1} -> {:.1}",
            before.0, after.0, before.1, after.1
        );
        assert!(after.0 <= before.0 && after.1 <= before.1, "N={n}");
        if n == 1 {
            // Unsharded, both sides coalesce once reused pages come out ascending.
            assert!(after.0 * 2.0 < before.0 && after.1 * 2.0 < before.1);
        } else {
            // A rank's pages sit N apart on the decode side: P/D runs never coalesce.
            assert_eq!(after.0, before.0);
            assert!(after.1 < before.1);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Scratch budget.
// ---------------------------------------------------------------------------------------------

#[test]
fn scratch_budget_follows_the_rule_at_every_shard_size() {
    let mut rng = common::rng("scratch_budget_follows_the_rule_at_every_shard_size");
    let g = small();
    let row = (g.target.row_bytes() + 132) as u64;
    for n in SHARDS {
        for _ in 0..200 {
            let mut req = BudgetRequest::new(
                rng.random_range(1u64 << 40..1 << 42),
                rng.random_range(1..200_000),
                rng.random_range(1..20_000),
            );
            req.contexts = rng.random_range(1..=8);
            let placement = Placement::new(n).unwrap();
            let (rows, prefix) = Budget::scratch(&req, n).unwrap();
            if n == 1 {
                assert_eq!((rows, prefix), (0, 0), "no scratch unsharded");
                continue;
            }
            let stride = u64::from(n) * 64;
            let want_prefix = req.contexts * req.context_len.div_ceil(stride) * stride;
            assert_eq!(prefix, want_prefix);
            assert_eq!(rows, want_prefix + req.chunk_size.div_ceil(64) * 64 + 64);
            // The prefix region is whole pages of every owner.
            assert_eq!(prefix % stride, 0);
            let layout = ScratchLayout::new(prefix, req.chunk_size).unwrap();
            assert_eq!(layout.rows(), rows);
            assert_eq!(layout.trash_page(), rows / 64 - 1);
            let b = Budget::plan(&req, &g, placement).unwrap();
            assert_eq!(b.scratch_bytes, 2 * rows * row * 2, "draft doubles");
        }
    }
    // A 4,097-token context at N = 2 needs whole rounds of 2 pages.
    let mut req = BudgetRequest::new(1 << 40, 4097, 64);
    req.contexts = 1;
    assert_eq!(Budget::scratch(&req, 2).unwrap(), (4224 + 64 + 64, 4224));
    assert!(ScratchLayout::new(100, 64).is_err());
}

// ---------------------------------------------------------------------------------------------
// Gather plans.
// ---------------------------------------------------------------------------------------------

/// One request of a random batch: start owner, prefix pages, chunk pages.
#[derive(Debug, Clone)]
struct Req {
    start: u32,
    prefix: Vec<LogicalPage>,
    chunk: Vec<LogicalPage>,
}

impl Req {
    fn gather(&self) -> GatherRequest<'_> {
        GatherRequest {
            start_owner: self.start,
            prefix: &self.prefix,
            chunk: &self.chunk,
        }
    }
}

/// A random batch of a shard group with `ppr` pages per rank: cached chains (some requests
/// share a prefix of another's, as a radix tree hands out), each extended by a chunk.
fn random_batch(rng: &mut StdRng, n: u32, ppr: u64) -> Vec<Req> {
    let placement = Placement::new(n).unwrap();
    let mut a = ShardAllocator::new(placement, ppr).unwrap();
    let mut reqs: Vec<Req> = Vec::new();
    for _ in 0..rng.random_range(0..5) {
        let (start, prefix) = match reqs.len() {
            len if len > 0 && rng.random_bool(0.3) => {
                let other = &reqs[rng.random_range(0..len)];
                let k = rng.random_range(0..=other.prefix.len());
                (other.start, other.prefix[..k].to_vec())
            }
            _ => match a.alloc(AllocRequest {
                chain: ChainStart::New,
                pages: rng.random_range(0..20),
            }) {
                Ok(c) => (c.start_owner, c.pages),
                Err(_) => continue,
            },
        };
        let chunk = match a.alloc(AllocRequest {
            chain: ChainStart::Extend {
                start_owner: start,
                prefix_tokens: 64 * prefix.len(),
            },
            pages: rng.random_range(0..6),
        }) {
            Ok(c) => c.pages,
            Err(_) => Vec::new(),
        };
        reqs.push(Req {
            start,
            prefix,
            chunk,
        });
    }
    reqs
}

/// What a gather plan must say, computed the plain way.
struct Reference {
    block: u64,
    send: Vec<Vec<LocalPage>>,
    table: Vec<i64>,
    overflow: Option<&'static str>,
}

fn reference(n: u32, layout: ScratchLayout, logical: u64, reqs: &[Req]) -> Reference {
    let n64 = u64::from(n);
    let block: u64 = reqs
        .iter()
        .map(|r| (r.prefix.len() as u64).div_ceil(n64))
        .sum();
    let chunk: Vec<LogicalPage> = reqs.iter().flat_map(|r| r.chunk.clone()).collect();
    let overflow = if n64 * block > layout.prefix_pages() {
        Some("prefix")
    } else if chunk.len() as u64 > layout.chunk_pages() {
        Some("chunk")
    } else {
        None
    };
    let mut table = vec![layout.trash_page() as i64; logical as usize];
    let mut send = Vec::new();
    for o in 0..n64 {
        let mine: BTreeSet<u64> = reqs
            .iter()
            .flat_map(|r| r.prefix.iter())
            .filter(|p| p.0 % n64 == o)
            .map(|p| p.0 / n64)
            .collect();
        let mut list: Vec<LocalPage> = mine.iter().map(|&l| LocalPage(l)).collect();
        for (k, &local) in mine.iter().enumerate() {
            table[(local * n64 + o) as usize] = (o * block + k as u64) as i64;
        }
        list.resize(block as usize, LocalPage(0));
        send.push(list);
    }
    for (j, p) in chunk.iter().enumerate() {
        table[p.0 as usize] = (layout.prefix_pages() + j as u64) as i64;
    }
    Reference {
        block,
        send,
        table,
        overflow,
    }
}

#[test]
fn gather_plans_match_the_reference_at_every_shard_size() {
    let mut rng = common::rng("gather_plans_match_the_reference_at_every_shard_size");
    for n in SHARDS {
        let placement = Placement::new(n).unwrap();
        let ppr = 48;
        let logical = u64::from(n) * ppr;
        let (mut built, mut refused) = (0, 0);
        for _ in 0..300 {
            let reqs = random_batch(&mut rng, n, ppr);
            let gather: Vec<GatherRequest> = reqs.iter().map(Req::gather).collect();
            // Sometimes too small a region, to see the refusals agree.
            let prefix_pages = rng.random_range(0..80u64);
            let layout =
                ScratchLayout::new(64 * prefix_pages, rng.random_range(0..40 * 64)).unwrap();
            let want = reference(n, layout, logical, &reqs);
            match GatherPlan::new(placement, layout, logical, &gather) {
                Ok(plan) => {
                    assert_eq!(want.overflow, None, "N={n}: {reqs:?}");
                    assert_eq!(plan.block(), want.block);
                    assert_eq!(plan.gathered_pages(), want.block * u64::from(n));
                    for r in 0..n {
                        assert_eq!(plan.send_list(r).unwrap(), &want.send[r as usize][..]);
                        let owned = want.send[r as usize].iter().filter(|p| p.0 != 0).count();
                        assert_eq!(plan.owned_pages(r).unwrap(), owned);
                    }
                    let table = plan.page_table().unwrap();
                    assert_eq!(table, want.table, "N={n}: {reqs:?}");
                    for (l, &s) in table.iter().enumerate() {
                        assert_eq!(plan.scratch_page(LogicalPage(l as u64)), s as u64);
                    }
                    let distinct: BTreeSet<_> = reqs.iter().flat_map(|r| &r.prefix).collect();
                    assert_eq!(plan.prefix_pages(), distinct.len());
                    assert!(plan.to_string().starts_with("gather of"));
                    built += 1;
                }
                Err(Error::ScratchOverflow { region, .. }) => {
                    assert_eq!(want.overflow, Some(region), "N={n}: {reqs:?}");
                    refused += 1;
                }
                Err(e) => panic!("N={n}: {e} for {reqs:?}"),
            }
        }
        assert!(
            built > 50 && refused > 10,
            "N={n}: {built} built, {refused} refused"
        );
    }
}

#[test]
fn gather_plans_refuse_bad_batches() {
    let p2 = Placement::new(2).unwrap();
    let layout = ScratchLayout::new(64 * 16, 64 * 8).unwrap();
    let plan = |reqs: &[GatherRequest]| GatherPlan::new(p2, layout, 40, reqs);
    let req = |start, prefix: &'static [u64], chunk: &'static [u64]| (start, lp(prefix), lp(chunk));
    type Case = (
        (u32, Vec<LogicalPage>, Vec<LogicalPage>),
        fn(&Error) -> bool,
    );
    let cases: Vec<Case> = vec![
        // Owners not cyclic: position 1 of a chain starting at owner 0 must be owner 1.
        (req(0, &[2, 4], &[]), |e| {
            matches!(
                e,
                Error::WrongOwner {
                    page: 4,
                    owner: 0,
                    expected: 1
                }
            )
        }),
        // ... also across the prefix / chunk boundary.
        (req(1, &[3], &[5]), |e| {
            matches!(e, Error::WrongOwner { page: 5, .. })
        }),
        (req(0, &[0, 3], &[]), |e| {
            matches!(e, Error::ReservedPage { page: 0, shard: 2 })
        }),
        (req(0, &[40, 3], &[]), |e| {
            matches!(
                e,
                Error::OutOfRange {
                    index: 40,
                    limit: 40,
                    ..
                }
            )
        }),
        (req(2, &[4], &[]), |e| {
            matches!(e, Error::InvalidArgument(_))
        }),
        // A page twice in one chain.
        (req(0, &[2, 3, 2, 5], &[]), |e| {
            matches!(
                e,
                Error::DuplicatePage {
                    page: 2,
                    first: 0,
                    second: 2,
                    ..
                }
            )
        }),
        // Too many chunk pages: 9 of 8.
        (req(0, &[], &[2, 3, 4, 5, 6, 7, 8, 9, 10]), |e| {
            matches!(
                e,
                Error::ScratchOverflow {
                    region: "chunk",
                    needed: 576,
                    limit: 512
                }
            )
        }),
        // 17 prefix pages: a block of 9 per owner, 18 pages > 16.
        (
            req(
                0,
                &[2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18],
                &[],
            ),
            |e| {
                matches!(
                    e,
                    Error::ScratchOverflow {
                        region: "prefix",
                        needed: 1152,
                        limit: 1024
                    }
                )
            },
        ),
    ];
    for ((start, prefix, chunk), expected) in &cases {
        let r = GatherRequest {
            start_owner: *start,
            prefix,
            chunk,
        };
        let e = plan(&[r]).unwrap_err();
        assert!(expected(&e), "{prefix:?} + {chunk:?}: {e}");
    }
    // A page in one request's prefix and another's chunk; a chunk page twice in the batch.
    let (a, b) = (lp(&[2, 3]), lp(&[4]));
    let first = GatherRequest {
        start_owner: 0,
        prefix: &a,
        chunk: &b,
    };
    let again = GatherRequest {
        start_owner: 0,
        prefix: &b,
        chunk: &[],
    };
    assert!(matches!(
        plan(&[first, again]),
        Err(Error::DuplicatePage { page: 4, .. })
    ));
    let twice = GatherRequest {
        start_owner: 0,
        prefix: &[],
        chunk: &b,
    };
    assert!(matches!(
        plan(&[twice, twice]),
        Err(Error::DuplicatePage { page: 4, .. })
    ));
    // A shared prefix is gathered once; a block still counts it per request.
    let shared = plan(&[again, again]).unwrap();
    assert_eq!((shared.block(), shared.prefix_pages()), (2, 1));
    assert_eq!(shared.send_list(0).unwrap(), &[LocalPage(2), LocalPage(0)]);
    assert!(shared.send_list(2).is_err());
}

// ---------------------------------------------------------------------------------------------
// The scratch table kernel.
// ---------------------------------------------------------------------------------------------

/// A random valid plan of N = `n` with `ppr` pages per rank, and its layout.
fn random_plan(rng: &mut StdRng, n: u32, ppr: u64) -> GatherPlan {
    let placement = Placement::new(n).unwrap();
    loop {
        let reqs = random_batch(rng, n, ppr);
        let gather: Vec<GatherRequest> = reqs.iter().map(Req::gather).collect();
        let layout = ScratchLayout::new(64 * 64 * u64::from(n), 64 * 40).unwrap();
        if let Ok(plan) = GatherPlan::new(placement, layout, u64::from(n) * ppr, &gather) {
            if plan.block() > 0 || rng.random_bool(0.1) {
                return plan;
            }
        }
    }
}

fn read_table(b: &dyn Backend, t: &ScratchTable) -> Vec<i64> {
    b.synchronize().unwrap();
    i64s_from_bytes(
        &b.read_sync(t.table(), 0, 8 * t.logical_pages() as usize)
            .unwrap(),
    )
}

// One scratch table rebuilt for random plans holds each plan's page table; a plan of
// another index space is refused.
common::on_cpu_and_gpu!(scratch_table_matches_the_plans, |device| {
    let (b, mut rng) = (device.stream(), device.rng());
    for n in SHARDS {
        let ppr = 48;
        let mut table = ScratchTable::new(b.clone(), u64::from(n) * ppr, 512).unwrap();
        b.fill(table.table(), POISON).unwrap();
        for _ in 0..20 {
            let plan = random_plan(&mut rng, n, ppr);
            table.build(&plan).unwrap();
            assert_eq!(read_table(b.as_ref(), &table), plan.page_table().unwrap());
        }
        let other = random_plan(&mut rng, n, ppr + 1);
        assert!(table.build(&other).is_err(), "another index space");
    }
});

/// Runs `kvs_scratch_table` on raw entries; returns the table and the rejected position.
fn raw_table(
    b: &dyn Backend,
    pages: &[i64],
    scratch: &[i64],
    table_len: u64,
    trash: u64,
) -> (Vec<i64>, Option<u64>) {
    let pad = |v: &[i64]| if v.is_empty() { vec![0] } else { v.to_vec() };
    let pages_buf = upload_i64s_sync(b, &pad(pages)).unwrap();
    let scratch_buf = upload_i64s_sync(b, &pad(scratch)).unwrap();
    let out = b
        .alloc(8 * table_len.max(1) as usize, MemoryKind::Device)
        .unwrap();
    b.fill(&out, POISON).unwrap();
    let params = abi::kvs_scratch_table_params {
        pages: pages_buf.addr(),
        scratch_pages: scratch_buf.addr(),
        num_entries: pages.len() as u64,
        table: out.addr(),
        table_len,
        trash_page: trash,
        ..Default::default()
    };
    // SAFETY: the entry buffers hold `num_entries` int64s each and the output `table_len`
    // int64s, all of this backend, alive until the synchronize below.
    unsafe { b.scratch_table(params).unwrap() };
    let rejected = match b.synchronize() {
        Ok(()) => None,
        Err(Error::KernelRejected { kernel, position }) => {
            assert_eq!(kernel, "kvs_scratch_table");
            Some(position)
        }
        Err(e) => panic!("{e}"),
    };
    let table = i64s_from_bytes(&b.read_sync(&out, 0, 8 * table_len as usize).unwrap());
    (table, rejected)
}

/// Raw entries of `kvs_scratch_table`: pages, scratch pages, table length, trash page, and the
/// position the kernel must reject (if any).
type RawTable = (Vec<i64>, Vec<i64>, u64, u64, Option<u64>);

/// What one `kvs_scratch_table` run made: the table and the rejected position.
type Made = (Vec<i64>, Option<u64>);

/// Bad entries, and a few good ones.
fn bad_tables() -> Vec<RawTable> {
    vec![
        (vec![1, 3, 7], vec![0, 5, 9], 10, 12, None),
        (vec![], vec![], 6, 3, None),
        // Not ascending at 2.
        (vec![1, 5, 4, 8], vec![0, 1, 2, 3], 10, 12, Some(2)),
        // Equal pages at 1.
        (vec![2, 2], vec![0, 1], 10, 12, Some(1)),
        // A page beyond the table at 2, a negative one at 0.
        (vec![-1, 3, 10], vec![0, 1, 2], 10, 12, Some(0)),
        // Scratch pages at or beyond the trash page, or negative: those pages map to trash.
        (vec![1, 2, 3], vec![4, 12, -2], 10, 12, Some(1)),
        (vec![5], vec![13], 8, 12, Some(0)),
    ]
}

// `kvs_scratch_table` reports the first bad entry (pages not ascending, a page beyond the
// table or negative, a scratch page at or beyond the trash page) and maps what it cannot
// place to the trash page; a table longer than int64 indices reach is refused before any
// address is used. Random entries (unsorted and out of range as they come) and a large
// sorted table give the GPU the same bytes to make as the twin.
common::on_cpu_and_gpu!(scratch_table_reports_bad_entries, |device| -> Vec<Made> {
    let b = device.stream();
    let mut rng = device.rng();
    // Where the entries are sorted, the table is the plain map.
    let check_map = |pages: &[i64], scratch: &[i64], len: u64, trash: u64, table: &[i64]| {
        if pages.windows(2).all(|w| w[0] < w[1]) {
            let mut want = vec![trash as i64; len as usize];
            for (&page, &s) in pages.iter().zip(scratch) {
                if (0..len as i64).contains(&page) && (0..trash as i64).contains(&s) {
                    want[page as usize] = s;
                }
            }
            assert!(table == want, "{pages:?} -> {scratch:?}");
        }
    };
    let mut cases = bad_tables();
    let sorted: Vec<i64> = (0..100_000).map(|i| 3 * i + 1).collect();
    let scratch: Vec<i64> = (0..100_000).map(|i| (i * 7) % 250_000).collect();
    cases.push((sorted, scratch, 300_001, 250_000, None));
    let mut out = Vec::new();
    for (pages, scratch, len, trash, rejected) in cases {
        let (table, got) = raw_table(b.as_ref(), &pages, &scratch, len, trash);
        assert_eq!(
            got,
            rejected,
            "{} entries from {:?}",
            pages.len(),
            pages.first()
        );
        check_map(&pages, &scratch, len, trash, &table);
        out.push((table, got));
    }
    for _ in 0..20 {
        let k = rng.random_range(0..300);
        let pages: Vec<i64> = (0..k).map(|_| rng.random_range(-3..400)).collect();
        let scratch: Vec<i64> = (0..k).map(|_| rng.random_range(-3..300)).collect();
        let (table, got) = raw_table(b.as_ref(), &pages, &scratch, 350, 280);
        check_map(&pages, &scratch, 350, 280, &table);
        out.push((table, got));
    }
    // SAFETY: refused by the parameter check (a table longer than int64 indices reach)
    // before any address is used.
    let e = unsafe {
        b.scratch_table(abi::kvs_scratch_table_params {
            table_len: u64::MAX,
            ..Default::default()
        })
    }
    .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    out
});

// ---------------------------------------------------------------------------------------------
// Pack and the all-gather emulation.
// ---------------------------------------------------------------------------------------------

fn copy_launch(b: &dyn Backend) -> Launch {
    Launch {
        ctas: 8,
        threads: b.max_threads(KernelFamily::Copy),
    }
}

/// Every block of page `page` of staging `s`: component by component, layer by layer (the
/// order of `DevicePool::read_pages_sync`).
fn staging_page(b: &dyn Backend, s: &Staging, page: u64) -> Vec<u8> {
    let mut out = Vec::new();
    for c in s.components() {
        for l in 0..c.layers() {
            let buf = s.layer(c.component, StoredLayer(l)).unwrap();
            let at = page as usize * c.block_bytes;
            out.extend(b.read_sync(&buf, at, c.block_bytes).unwrap());
        }
    }
    out
}

/// Random pools of a CP group, filled from a random unsharded pool `U` (local page `l` of `U`
/// holds logical page `l`) by owner-filtered block copies.
fn sharded_pools(
    b: &Arc<dyn Backend>,
    g: &CacheGeometry,
    n: u32,
    ppr: u64,
    rng: &mut StdRng,
) -> (Arc<DevicePool>, Vec<Arc<DevicePool>>) {
    use kvshard::copy::{BlockCopyPlan, PageSelection};
    let placement = Placement::new(n).unwrap();
    let logical = u64::from(n) * ppr;
    let u =
        Arc::new(DevicePool::allocate(b.as_ref(), g, Placement::unsharded(), 0, logical).unwrap());
    let storage = u.storage().unwrap();
    b.write_sync(storage, 0, &synth::bytes(rng, storage.len()))
        .unwrap();
    let pages: Vec<LogicalPage> = (u64::from(n)..logical).map(LogicalPage).collect();
    let locals: Vec<LocalPage> = pages.iter().map(|p| LocalPage(p.0)).collect();
    let mut ranks = Vec::new();
    for r in 0..n {
        let pool = Arc::new(DevicePool::allocate(b.as_ref(), g, placement, r, ppr).unwrap());
        pool.fill(b.as_ref(), POISON).unwrap();
        let plan = BlockCopyPlan::new(
            u.as_ref(),
            PageSelection::Local(locals.clone()),
            pool.as_ref(),
            PageSelection::Logical {
                pages: pages.clone(),
                placement,
                rank: r,
            },
            pages.len(),
        )
        .unwrap();
        let copy =
            BlockCopy::prepare_sync(b.as_ref(), plan, u.clone(), pool.clone(), None).unwrap();
        copy.run(b.as_ref(), copy_launch(b.as_ref())).unwrap();
        ranks.push(pool);
    }
    b.synchronize().unwrap();
    (u, ranks)
}

/// Packs rank `pool`'s send list (every layer, or model layer `only`) into a new poisoned send
/// buffer; returns it.
fn pack(
    b: &Arc<dyn Backend>,
    plan: &GatherPlan,
    pool: &Arc<DevicePool>,
    only: Option<ModelLayer>,
) -> Arc<Staging> {
    let send = Arc::new(Staging::new(b.as_ref(), pool.geometry(), plan.block().max(1)).unwrap());
    b.fill(send.buffer(), POISON).unwrap();
    let copy_plan = plan
        .pack_plan(pool, &send, |m| only.is_none_or(|o| o == m))
        .unwrap();
    let copy =
        BlockCopy::prepare_sync(b.as_ref(), copy_plan, pool.clone(), send.clone(), None).unwrap();
    copy.run(b.as_ref(), copy_launch(b.as_ref())).unwrap();
    b.synchronize().unwrap();
    send
}

// Every rank of a random batch packs its send list, every layer and one layer at a time:
// each send buffer holds the rank's listed pages in order, and a one-layer pack only that
// layer's blocks.
common::on_cpu_and_gpu!(
    pack_writes_the_send_lists_every_layer_or_one,
    |device| -> Vec<Vec<u8>> {
        let b = device.stream();
        let mut rng = device.rng();
        let g = small();
        let mut out = Vec::new();
        for n in [1, 2, 3, 4] {
            let ppr = 24;
            let (_, pools) = sharded_pools(&b, &g, n, ppr, &mut rng);
            let plan = random_plan(&mut rng, n, ppr);
            for (r, pool) in pools.iter().enumerate() {
                let list = plan.send_list(r as u32).unwrap();
                let send = pack(&b, &plan, pool, None);
                for (k, &local) in list.iter().enumerate() {
                    let want = pool
                        .read_pages_sync(b.as_ref(), &[local])
                        .unwrap()
                        .remove(0);
                    assert!(
                        staging_page(b.as_ref(), &send, k as u64) == want,
                        "N={n} rank {r} entry {k}"
                    );
                }
                out.push(b.read_sync(send.buffer(), 0, send.buffer().len()).unwrap());
                // One layer at a time: the draft's layer (model layer 3), then target layer 1
                // (which shares its indexer, so only its latent moves).
                for layer in [3, 1] {
                    let one = pack(&b, &plan, pool, Some(ModelLayer(layer)));
                    for c in send.components() {
                        for l in 0..c.layers() {
                            let moved = c.model_layers[l] == ModelLayer(layer);
                            let buf = one.layer(c.component, StoredLayer(l)).unwrap();
                            let want = send.layer(c.component, StoredLayer(l)).unwrap();
                            let len = list.len() * c.block_bytes;
                            let got = b.read_sync(&buf, 0, len).unwrap();
                            if moved {
                                assert!(got == b.read_sync(&want, 0, len).unwrap());
                            } else {
                                assert!(got.iter().all(|&x| x == POISON), "{} {l}", c.component);
                            }
                        }
                    }
                    out.push(b.read_sync(one.buffer(), 0, one.buffer().len()).unwrap());
                }
            }
        }
        out
    }
);

// Every rank packs its send list, device copies land every send buffer in every rank's
// scratch (owner-major, as an all-gather would), and the scratch read through the page
// table (built by the kernel) equals the unsharded pool's pages in logical order; the chunk
// region and the trash page stay untouched.
common::on_cpu_and_gpu!(
    all_gather_emulation_reads_back_the_unsharded_pool,
    |device| -> Vec<Vec<u8>> {
        let b = device.stream();
        let mut rng = device.rng();
        let g = small();
        let mut out = Vec::new();
        for n in [1, 2, 3, 4, 8] {
            let ppr = 16;
            let (u, pools) = sharded_pools(&b, &g, n, ppr, &mut rng);
            let reqs = loop {
                let reqs = random_batch(&mut rng, n, ppr);
                if reqs.iter().any(|r| !r.prefix.is_empty()) {
                    break reqs;
                }
            };
            let gather: Vec<GatherRequest> = reqs.iter().map(Req::gather).collect();
            let layout = ScratchLayout::new(64 * 80, 64 * 30).unwrap();
            let logical = u64::from(n) * ppr;
            let plan =
                GatherPlan::new(Placement::new(n).unwrap(), layout, logical, &gather).unwrap();
            let sends: Vec<Arc<Staging>> = pools.iter().map(|p| pack(&b, &plan, p, None)).collect();
            let mut table = ScratchTable::new(b.clone(), logical, 256).unwrap();
            table.build(&plan).unwrap();
            let table = read_table(b.as_ref(), &table);
            for _rank in 0..n {
                let scratch = Arc::new(Staging::new(b.as_ref(), &g, layout.pages()).unwrap());
                b.fill(scratch.buffer(), POISON).unwrap();
                for (owner, send) in sends.iter().enumerate() {
                    let landing = plan.landing_plan(owner as u32, send, &scratch).unwrap();
                    let copy = BlockCopy::prepare_sync(
                        b.as_ref(),
                        landing,
                        send.clone(),
                        scratch.clone(),
                        None,
                    )
                    .unwrap();
                    copy.run(b.as_ref(), copy_launch(b.as_ref())).unwrap();
                }
                b.synchronize().unwrap();
                for r in &reqs {
                    for &page in &r.prefix {
                        let at = table[page.0 as usize] as u64;
                        let want = u.read_pages_sync(b.as_ref(), &[LocalPage(page.0)]).unwrap();
                        assert!(
                            staging_page(b.as_ref(), &scratch, at) == want[0],
                            "N={n} page {}",
                            page.0
                        );
                    }
                }
                for s in plan.gathered_pages()..layout.pages() {
                    assert!(staging_page(b.as_ref(), &scratch, s)
                        .iter()
                        .all(|&x| x == POISON));
                }
                out.push(
                    b.read_sync(scratch.buffer(), 0, scratch.buffer().len())
                        .unwrap(),
                );
            }
        }
        out
    }
);

// ---------------------------------------------------------------------------------------------
// Admission and eviction.
// ---------------------------------------------------------------------------------------------

/// The admission rules, written out with wide integers.
#[derive(Default)]
struct RefAdmission {
    block: u128,
    chunk_pages: u128,
    reserved: u128,
    admitted: usize,
}

#[derive(Debug, PartialEq, Eq)]
enum RefDecision {
    Admit(u64, bool),
    DeferPrefix,
    DeferChunk,
    DeferPool,
    Never(&'static str),
}

impl RefAdmission {
    fn offer(
        &mut self,
        n: u32,
        limits: AdmissionLimits,
        capacity: u64,
        c: Candidate,
    ) -> RefDecision {
        let n = u128::from(n);
        let block = self.block + (u128::from(c.prefix_len) / 64).div_ceil(n);
        if n * block * 64 > u128::from(limits.max_prefix_tokens) {
            return if self.admitted == 0 {
                RefDecision::Never("prefix region")
            } else {
                RefDecision::DeferPrefix
            };
        }
        let mut extend = u128::from(c.extend_len);
        let mut last = true;
        if (self.chunk_pages + extend.div_ceil(64)) * 64 > u128::from(limits.chunk_tokens) {
            let room = u128::from(limits.chunk_tokens) - self.chunk_pages * 64;
            // The longest chunk of at most room / 64 pages after which the request's prefix is
            // whole pages: counted token by token.
            let prefix = u128::from(c.prefix_len);
            extend = (1..=room / 64 * 64)
                .rev()
                .find(|e| e.div_ceil(64) <= room / 64 && (prefix + e) % 64 == 0)
                .unwrap_or(0);
            last = false;
            if extend == 0 {
                return if self.admitted == 0 {
                    RefDecision::Never("chunk region")
                } else {
                    RefDecision::DeferChunk
                };
            }
        }
        let reserved = self.reserved + extend + n * 64;
        if reserved > u128::from(capacity) {
            return RefDecision::DeferPool;
        }
        self.block = block;
        self.chunk_pages += extend.div_ceil(64);
        self.reserved = reserved;
        self.admitted += 1;
        RefDecision::Admit(extend as u64, last)
    }
}

#[test]
fn admission_matches_the_reference_at_every_shard_size() {
    let mut rng = common::rng("admission_matches_the_reference_at_every_shard_size");
    let mut seen = [0usize; 6];
    for n in SHARDS {
        let placement = Placement::new(n).unwrap();
        for _ in 0..500 {
            let limits = AdmissionLimits {
                max_prefix_tokens: rng.random_range(0..64u64) * 64 * u64::from(n),
                chunk_tokens: rng.random_range(0..8192),
            };
            let capacity = rng.random_range(0..40_000);
            let mut a = Admission::new(placement, limits, capacity);
            let mut r = RefAdmission::default();
            for _ in 0..rng.random_range(1..12) {
                let c = Candidate {
                    prefix_len: rng.random_range(0..3000),
                    extend_len: rng.random_range(0..5000),
                };
                let want = r.offer(n, limits, capacity, c);
                let got = a.offer(c);
                let kind = match (&got, &want) {
                    (Ok(Decision::Admit { extend_len, last }), RefDecision::Admit(e, l)) => {
                        assert_eq!((extend_len, last), (e, l));
                        if !last {
                            assert_eq!(
                                (c.prefix_len + extend_len) % 64,
                                0,
                                "a continuing chunk leaves a prefix of whole pages"
                            );
                            assert!(*extend_len < c.extend_len);
                        }
                        usize::from(!last)
                    }
                    (Ok(Decision::Defer(Deferral::PrefixRegion { .. })), RefDecision::DeferPrefix) => 2,
                    (Ok(Decision::Defer(Deferral::ChunkRegion { .. })), RefDecision::DeferChunk) => 3,
                    (Ok(Decision::Defer(Deferral::Pool { needed, available })), RefDecision::DeferPool) => {
                        assert!(needed > available);
                        4
                    }
                    (Err(Error::NeverAdmissible { what, .. }), RefDecision::Never(w)) => {
                        assert_eq!(what, w);
                        5
                    }
                    _ => panic!("N={n} {limits:?} capacity {capacity}: {c:?} gave {got:?}, the reference {want:?}"),
                };
                seen[kind] += 1;
                assert_eq!(u128::from(a.block()), r.block);
                assert_eq!(u128::from(a.chunk_pages()), r.chunk_pages);
                assert_eq!(u128::from(a.reserved_tokens()), r.reserved);
                assert_eq!(a.admitted(), r.admitted);
            }
        }
    }
    assert!(seen.iter().all(|&k| k > 0), "every decision seen: {seen:?}");
}

#[test]
fn admission_refuses_what_can_never_fit_and_defers_the_rest() {
    let p2 = Placement::new(2).unwrap();
    let limits = AdmissionLimits {
        max_prefix_tokens: 2 * 64 * 10,
        chunk_tokens: 1000,
    };
    let mut a = Admission::new(p2, limits, 1 << 20);
    // 21 prefix pages: a block of 11 per owner, 22 pages > 20. First of the pass: an error.
    let e = a
        .offer(Candidate {
            prefix_len: 21 * 64,
            extend_len: 10,
        })
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::NeverAdmissible {
                request: 0,
                what: "prefix region",
                needed: 1408,
                limit: 1280
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("can never be admitted"));
    // 990 tokens are 16 pages, 1024 > 1000: chunked to 15 whole pages.
    assert_eq!(
        a.offer(Candidate {
            prefix_len: 64 * 8,
            extend_len: 990
        })
        .unwrap(),
        Decision::Admit {
            extend_len: 960,
            last: false
        }
    );
    assert_eq!(
        (a.block(), a.chunk_pages(), a.reserved_tokens()),
        (4, 15, 960 + 128)
    );
    // Now not one page of chunk is left, and the prefix region is still there.
    assert!(matches!(
        a.offer(Candidate {
            prefix_len: 0,
            extend_len: 1
        }),
        Ok(Decision::Defer(Deferral::ChunkRegion {
            needed: 1024,
            limit: 1000
        }))
    ));
    assert!(matches!(
        a.offer(Candidate {
            prefix_len: 64 * 13,
            extend_len: 1
        }),
        Ok(Decision::Defer(Deferral::PrefixRegion {
            needed: 1408,
            limit: 1280
        }))
    ));
    // A chunk region below one page can never take anything.
    let tiny = AdmissionLimits {
        max_prefix_tokens: u64::MAX,
        chunk_tokens: 63,
    };
    let e = Admission::new(Placement::unsharded(), tiny, 1 << 20)
        .offer(Candidate {
            prefix_len: 0,
            extend_len: 64,
        })
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::NeverAdmissible {
                what: "chunk region",
                ..
            }
        ),
        "{e}"
    );
    // A pool that is full defers even the first request: eviction can fix that.
    let mut full = Admission::new(p2, limits, 200);
    let d = full
        .offer(Candidate {
            prefix_len: 0,
            extend_len: 100,
        })
        .unwrap();
    assert_eq!(
        d,
        Decision::Defer(Deferral::Pool {
            needed: 228,
            available: 200
        })
    );
    assert!(Deferral::Pool {
        needed: 228,
        available: 200
    }
    .to_string()
    .contains("228 of 200"));
    // Huge inputs overflow cleanly.
    let mut wide = Admission::new(
        p2,
        AdmissionLimits {
            max_prefix_tokens: u64::MAX,
            chunk_tokens: u64::MAX,
        },
        u64::MAX,
    );
    assert!(matches!(
        wide.offer(Candidate {
            prefix_len: u64::MAX,
            extend_len: u64::MAX
        }),
        Err(Error::Overflow { .. })
    ));
}

#[test]
fn eviction_frees_until_the_request_fits_or_says_why_not() {
    let mut rng = common::rng("eviction_frees_until_the_request_fits_or_says_why_not");
    for n in SHARDS {
        let placement = Placement::new(n).unwrap();
        let ppr = 20;
        let mut a = ShardAllocator::new(placement, ppr).unwrap();
        // Fill the pool with chains the "radix tree" evicts oldest first.
        let mut chains = Vec::new();
        while let Ok(c) = a.alloc(AllocRequest {
            chain: ChainStart::New,
            pages: rng.random_range(1..8),
        }) {
            chains.push(c.pages);
        }
        let needed = rng.random_range(1..=a.request_overhead() * (ppr - 1) - 1);
        let mut evicted = 0;
        let done = evict_until_allocatable(&mut a, needed, |a| {
            let c = chains.remove(0);
            evicted += c.len();
            a.free(&c)
        });
        match done {
            Ok(e) => {
                assert!(a.admission_capacity() >= needed && e.capacity == a.admission_capacity());
                assert_eq!(e.pages_freed, evicted);
                // Minimal: one call fewer would not have done.
                assert!(e.calls > 0 || evicted == 0);
            }
            Err(e) => panic!("N={n}: {e}"),
        }
        // More than an empty pool holds.
        let most = u64::from(n) * 64 * (ppr - 1);
        let e = evict_until_allocatable(&mut a, most + 1, |_| Ok(())).unwrap_err();
        assert!(matches!(
            e,
            Error::EvictionStalled {
                reason: EvictionStall::NeverFits { most: m },
                ..
            } if m == most
        ));
        // A callback that frees nothing.
        let mut full = ShardAllocator::new(placement, ppr).unwrap();
        full.alloc(AllocRequest {
            chain: ChainStart::New,
            pages: (n as usize) * (ppr as usize - 1),
        })
        .unwrap();
        let e = evict_until_allocatable(&mut full, 64, |_| Ok(())).unwrap_err();
        assert!(
            matches!(
                e,
                Error::EvictionStalled {
                    needed: 64,
                    capacity: 0,
                    reason: EvictionStall::NothingFreed { calls: 1 }
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("freed nothing"));
        // The callback's own error comes back as it is.
        let e = evict_until_allocatable(&mut full, 64, |_| Err(Error::HiCache("busy".into())))
            .unwrap_err();
        assert!(matches!(e, Error::HiCache(_)));
        // Nothing to do.
        let e = evict_until_allocatable(&mut a, 0, |_| unreachable!()).unwrap();
        assert_eq!((e.calls, e.pages_freed), (0, 0));
    }
}
