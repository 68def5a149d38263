//! Sharding. The rotated-owner allocator against a model: random sequences of batches (new chains and
//! extensions of live ones), tail frees, matching allocations and bad frees, with the model
//! predicting every start owner and every exhaustion by counting chain positions one by one
//! (not with the allocator's closed form). After every step the invariants of
//! docs/design.md ("Ownership") are checked; a failed step must leave the allocator equal to its snapshot.
//! And the public sharding math, allocator, chains, budget and planners at extreme values
//! (module `edges`): `Ok` with consistent sizes, or `Err` changing nothing; never a panic.

use std::collections::BTreeSet;

use kvshard::index::{LocalPage, LogicalPage};
use kvshard::shard::{AllocRequest, ChainStart, Placement, ShardAllocator};
use kvshard::Error;
use proptest::prelude::*;

fn lp(pages: &[u64]) -> Vec<LogicalPage> {
    pages.iter().map(|&p| LogicalPage(p)).collect()
}

fn raw(pages: &[LogicalPage]) -> Vec<u64> {
    pages.iter().map(|p| p.0).collect()
}

#[derive(Debug, Clone)]
enum Req {
    New(usize),
    /// Extends the picked live chain (a new chain if there is none, or it is already extended
    /// in this batch: two extensions of one chain in a batch would claim the same positions).
    Extend {
        chain: usize,
        pages: usize,
    },
}

#[derive(Debug, Clone, Copy)]
enum Bad {
    AlreadyFree,
    Duplicate,
    NeverAllocated,
    Reserved,
    OutOfRange,
}

#[derive(Debug, Clone)]
enum Op {
    Batch(Vec<Req>),
    /// Evicts the last `pages` pages of a chain, as a radix tree evicts leaves.
    FreeTail {
        chain: usize,
        pages: usize,
    },
    /// Matching allocation for live pages (even picks) and foreign pages (odd picks).
    Matching(Vec<u64>),
    FreeLoose(usize),
    /// A free of live pages with one bad page in the middle.
    BadFree {
        chain: usize,
        bad: Bad,
        pick: u64,
    },
}

#[derive(Debug, Clone)]
struct Chain {
    start_owner: u32,
    pages: Vec<u64>,
}

/// What the allocator should hold, kept independently of it.
struct Model {
    n: u32,
    ppr: u64,
    chains: Vec<Chain>,
    /// Pages from matching allocations.
    loose: Vec<u64>,
    live: BTreeSet<u64>,
    ever: BTreeSet<u64>,
}

impl Model {
    fn free_of(&self, class: u32) -> usize {
        let live = self
            .live
            .iter()
            .filter(|&&p| p % u64::from(self.n) == u64::from(class))
            .count();
        (self.ppr - 1) as usize - live
    }

    /// The lowest class that cannot supply `needs`, as the allocator must report it.
    fn shortage(&self, needs: &[usize]) -> Option<(u32, usize, usize)> {
        (0..self.n).find_map(|c| {
            let free = self.free_of(c);
            (needs[c as usize] > free).then_some((c, needs[c as usize], free))
        })
    }

    fn take(&mut self, pages: &[u64]) -> Result<(), TestCaseError> {
        for &p in pages {
            prop_assert!(self.live.insert(p), "page {p} handed out twice");
            self.ever.insert(p);
        }
        Ok(())
    }

    fn give_back(&mut self, pages: &[u64]) {
        for p in pages {
            self.live.remove(p);
        }
    }
}

fn expect_exhausted(
    err: Error,
    expected: Option<(u32, usize, usize)>,
) -> Result<(), TestCaseError> {
    match (err, expected) {
        (
            Error::Exhausted {
                owner,
                needed,
                free,
            },
            Some(e),
        ) => {
            prop_assert_eq!((owner, needed, free), e);
        }
        (err, _) => {
            return Err(TestCaseError::fail(format!(
                "unexpected error {err}, model predicted {expected:?}"
            )))
        }
    }
    Ok(())
}

fn check_invariants(a: &ShardAllocator, m: &Model) -> Result<(), TestCaseError> {
    let n = m.n;
    for chain in &m.chains {
        let mut counts = vec![0usize; n as usize];
        for (p, &page) in chain.pages.iter().enumerate() {
            let owner = (page % u64::from(n)) as u32;
            prop_assert_eq!(
                owner,
                (chain.start_owner + (p % n as usize) as u32) % n,
                "owners are not cyclic along chain {:?}",
                chain
            );
            counts[owner as usize] += 1;
            let (lo, hi) = (counts.iter().min(), counts.iter().max());
            prop_assert!(
                hi.zip(lo).is_some_and(|(hi, lo)| hi - lo <= 1),
                "prefix of {} pages unbalanced: {counts:?}",
                p + 1
            );
        }
    }
    let mut chained: Vec<u64> = m.chains.iter().flat_map(|c| c.pages.clone()).collect();
    chained.extend(&m.loose);
    prop_assert_eq!(chained.len(), m.live.len(), "a live page is held twice");
    for page in 0..u64::from(n) * m.ppr + 2 {
        prop_assert_eq!(
            a.is_allocated(LogicalPage(page)),
            m.live.contains(&page),
            "page {}",
            page
        );
    }
    for c in 0..n {
        prop_assert_eq!(a.free_pages(c), m.free_of(c), "free pages of class {}", c);
    }
    let capacity = (u64::from(n) * (m.ppr - 1)) as usize;
    prop_assert_eq!(a.total_free() + m.live.len(), capacity);
    let min_free = (0..n).map(|c| m.free_of(c)).min().unwrap_or(0) as u64;
    prop_assert_eq!(a.admission_capacity(), u64::from(n) * 64 * min_free);
    prop_assert_eq!(a.request_overhead(), u64::from(n) * 64);
    Ok(())
}

fn batch(a: &mut ShardAllocator, m: &mut Model, reqs: &[Req]) -> Result<(), TestCaseError> {
    let n = m.n;
    let mut needs = vec![0usize; n as usize];
    let mut requests = Vec::new();
    // (chain index to extend or None, predicted start owner, first position)
    let mut predicted: Vec<(Option<usize>, u32, usize)> = Vec::new();
    for req in reqs {
        let extend = match *req {
            Req::Extend { chain, pages } if !m.chains.is_empty() => {
                let i = chain % m.chains.len();
                (!predicted.iter().any(|p| p.0 == Some(i))).then_some((i, pages))
            }
            _ => None,
        };
        let (chain, start_owner, first, pages) = match (extend, req) {
            (Some((i, pages)), _) => {
                let c = &m.chains[i];
                (Some(i), c.start_owner, c.pages.len(), pages)
            }
            (None, Req::New(pages) | Req::Extend { pages, .. }) => {
                // The most free pages left after the earlier requests; ties: lowest rank.
                let left = |c: u32| m.free_of(c) as i64 - needs[c as usize] as i64;
                let best = (0..n).fold(0, |b, c| if left(c) > left(b) { c } else { b });
                (None, best, 0, *pages)
            }
        };
        for j in 0..pages {
            needs[(start_owner as usize + first + j) % n as usize] += 1;
        }
        let request_chain = match chain {
            Some(_) => ChainStart::Extend {
                start_owner,
                prefix_tokens: first * 64,
            },
            None => ChainStart::New,
        };
        requests.push(AllocRequest {
            chain: request_chain,
            pages,
        });
        predicted.push((chain, start_owner, first));
    }
    let before = a.clone();
    match a.alloc_batch(&requests) {
        Ok(allocations) => {
            prop_assert_eq!(m.shortage(&needs), None, "batch should have failed");
            prop_assert_eq!(allocations.len(), requests.len());
            for (alloc, (chain, start_owner, first)) in allocations.into_iter().zip(predicted) {
                prop_assert_eq!(alloc.start_owner, start_owner);
                prop_assert_eq!(alloc.first_position, first);
                let pages = raw(&alloc.pages);
                m.take(&pages)?;
                match chain {
                    Some(i) => m.chains[i].pages.extend(pages),
                    None => m.chains.push(Chain { start_owner, pages }),
                }
            }
        }
        Err(err) => {
            prop_assert!(*a == before, "failed batch changed the allocator");
            expect_exhausted(err, m.shortage(&needs))?;
        }
    }
    Ok(())
}

fn matching(a: &mut ShardAllocator, m: &mut Model, picks: &[u64]) -> Result<(), TestCaseError> {
    let n = u64::from(m.n);
    let live: Vec<u64> = m.live.iter().copied().collect();
    let inputs: Vec<u64> = picks
        .iter()
        .map(|&p| match live.len() {
            len if p % 2 == 0 && len > 0 => live[(p / 2) as usize % len],
            // A page of another (larger) pool: only its class matters.
            _ => n + p * 7,
        })
        .collect();
    let mut needs = vec![0usize; m.n as usize];
    for &p in &inputs {
        needs[(p % n) as usize] += 1;
    }
    let before = a.clone();
    match a.alloc_matching(&lp(&inputs)) {
        Ok(out) => {
            let out = raw(&out);
            prop_assert_eq!(m.shortage(&needs), None, "matching should have failed");
            prop_assert_eq!(out.len(), inputs.len());
            for (o, i) in out.iter().zip(&inputs) {
                prop_assert_eq!(o % n, i % n, "class not kept");
            }
            m.take(&out)?;
            m.loose.extend(out);
        }
        Err(err) => {
            prop_assert!(*a == before, "failed matching changed the allocator");
            expect_exhausted(err, m.shortage(&needs))?;
        }
    }
    Ok(())
}

fn bad_free(
    a: &mut ShardAllocator,
    m: &Model,
    chain: usize,
    bad: Bad,
    pick: u64,
) -> Result<(), TestCaseError> {
    let n = u64::from(m.n);
    let total = n * m.ppr;
    let good: Vec<u64> = match m.chains.len() {
        0 => Vec::new(),
        len => m.chains[chain % len].pages.clone(),
    };
    let nth = |set: Vec<u64>| (!set.is_empty()).then(|| set[pick as usize % set.len()]);
    let bad_page = match bad {
        Bad::AlreadyFree => nth(m.ever.difference(&m.live).copied().collect()),
        Bad::Duplicate => good.first().copied(),
        Bad::NeverAllocated => nth((n..total).filter(|p| !m.ever.contains(p)).collect()),
        Bad::Reserved => Some(pick % n),
        Bad::OutOfRange => Some(total + pick),
    };
    let Some(bad_page) = bad_page else {
        return Ok(());
    };
    let half = good.len() / 2;
    let mut pages = good[..half].to_vec();
    pages.push(bad_page);
    pages.extend(&good[half..]);
    let before = a.clone();
    let err = a.free(&lp(&pages)).expect_err("a bad free must fail");
    prop_assert!(*a == before, "failed free changed the allocator");
    let ok = match (bad, &err) {
        (Bad::AlreadyFree, Error::DoubleFree { page }) => *page == bad_page,
        // The duplicate is the later copy: the first one is a valid free.
        (Bad::Duplicate, Error::DoubleFree { page }) => *page == bad_page,
        (Bad::NeverAllocated, Error::NeverAllocated { page }) => *page == bad_page,
        (Bad::Reserved, Error::ReservedPage { page, shard }) => {
            *page == bad_page && u64::from(*shard) == n
        }
        (Bad::OutOfRange, Error::OutOfRange { index, limit, .. }) => {
            *index as u64 == bad_page && *limit == total
        }
        _ => false,
    };
    prop_assert!(ok, "{bad:?} of page {bad_page} gave {err}");
    Ok(())
}

fn run(n: u32, ppr: u64, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut a = ShardAllocator::new(Placement::new(n).unwrap(), ppr).unwrap();
    let mut m = Model {
        n,
        ppr,
        chains: Vec::new(),
        loose: Vec::new(),
        live: BTreeSet::new(),
        ever: BTreeSet::new(),
    };
    check_invariants(&a, &m)?;
    for op in ops {
        match op {
            Op::Batch(reqs) => batch(&mut a, &mut m, &reqs)?,
            Op::FreeTail { chain, pages } => {
                if m.chains.is_empty() {
                    continue;
                }
                let i = chain % m.chains.len();
                let len = m.chains[i].pages.len();
                let tail = m.chains[i].pages.split_off(len - pages.min(len));
                a.free(&lp(&tail)).unwrap();
                m.give_back(&tail);
            }
            Op::Matching(picks) => matching(&mut a, &mut m, &picks)?,
            Op::FreeLoose(k) => {
                let k = k.min(m.loose.len());
                let freed: Vec<u64> = m.loose.drain(..k).collect();
                a.free(&lp(&freed)).unwrap();
                m.give_back(&freed);
            }
            Op::BadFree { chain, bad, pick } => bad_free(&mut a, &m, chain, bad, pick)?,
        }
        check_invariants(&a, &m)?;
    }
    Ok(())
}

fn req() -> impl Strategy<Value = Req> {
    prop_oneof![
        (0..20usize).prop_map(Req::New),
        (any::<usize>(), 0..20usize).prop_map(|(chain, pages)| Req::Extend { chain, pages }),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let bad = prop_oneof![
        Just(Bad::AlreadyFree),
        Just(Bad::Duplicate),
        Just(Bad::NeverAllocated),
        Just(Bad::Reserved),
        Just(Bad::OutOfRange),
    ];
    prop_oneof![
        4 => prop::collection::vec(req(), 0..5).prop_map(Op::Batch),
        2 => (any::<usize>(), 0..12usize).prop_map(|(chain, pages)| Op::FreeTail { chain, pages }),
        1 => prop::collection::vec(0..64u64, 0..12).prop_map(Op::Matching),
        1 => (0..8usize).prop_map(Op::FreeLoose),
        1 => (any::<usize>(), bad, 0..1000u64)
            .prop_map(|(chain, bad, pick)| Op::BadFree { chain, bad, pick }),
    ]
}

proptest! {
    #[test]
    fn allocator_matches_the_model(
        n in prop::sample::select(vec![1u32, 2, 3, 4, 8]),
        ppr in 2..24u64,
        ops in prop::collection::vec(op(), 1..40),
    ) {
        run(n, ppr, ops)?;
    }

    #[test]
    fn a_fresh_allocator_hands_out_each_class_lowest_pages_first(
        n in 1..9u32,
        ppr in 2..40u64,
        pages in 0..64usize,
    ) {
        let placement = Placement::new(n).unwrap();
        let mut a = ShardAllocator::new(placement, ppr).unwrap();
        let pages = pages.min(n as usize * (ppr as usize - 1));
        let chain = a.alloc(AllocRequest { chain: ChainStart::New, pages }).unwrap();
        // Every class is equally free, so the chain starts at rank 0.
        prop_assert_eq!(chain.start_owner, 0);
        for (p, &page) in chain.pages.iter().enumerate() {
            let class = (p % n as usize) as u32;
            let round = (p / n as usize) as u64;
            prop_assert_eq!(Some(page), placement.logical(class, LocalPage(1 + round)));
        }
    }
}

fn alloc(n: u32, ppr: u64) -> ShardAllocator {
    ShardAllocator::new(Placement::new(n).unwrap(), ppr).unwrap()
}

fn new_chain(pages: usize) -> AllocRequest {
    AllocRequest {
        chain: ChainStart::New,
        pages,
    }
}

fn extend(start_owner: u32, prefix_tokens: usize, pages: usize) -> AllocRequest {
    AllocRequest {
        chain: ChainStart::Extend {
            start_owner,
            prefix_tokens,
        },
        pages,
    }
}

#[test]
fn new_chains_start_at_the_freest_owner_counting_the_batch() {
    let mut a = alloc(4, 10);
    // 9 free per class. A 5-page chain from rank 0 takes 2,1,1,1 -> free 7,8,8,8: the next new
    // chain of the batch starts at rank 1 (tie of 1,2,3 goes to the lowest), taking 1 from
    // ranks 1 and 2 -> free 7,7,7,8: the third starts at rank 3.
    let got = a
        .alloc_batch(&[new_chain(5), new_chain(2), new_chain(1)])
        .unwrap();
    let starts: Vec<u32> = got.iter().map(|x| x.start_owner).collect();
    assert_eq!(starts, [0, 1, 3]);
    assert_eq!(
        (0..4).map(|c| a.free_pages(c)).collect::<Vec<_>>(),
        [7, 7, 7, 7]
    );
    // All tied again: rank 0.
    assert_eq!(a.alloc(new_chain(1)).unwrap().start_owner, 0);
}

#[test]
fn extending_continues_the_rotation() {
    let placement = Placement::new(3).unwrap();
    let mut a = ShardAllocator::new(placement, 8).unwrap();
    let head = a.alloc(extend(2, 0, 4)).unwrap();
    let tail = a.alloc(extend(2, 4 * 64, 5)).unwrap();
    assert_eq!((tail.start_owner, tail.first_position), (2, 4));
    let owners: Vec<u32> = head
        .pages
        .iter()
        .chain(&tail.pages)
        .map(|&p| placement.owner(p))
        .collect();
    assert_eq!(owners, [2, 0, 1, 2, 0, 1, 2, 0, 1]);
}

#[test]
fn misaligned_prefix_is_refused() {
    let mut a = alloc(2, 4);
    let before = a.clone();
    let err = a.alloc(extend(0, 65, 1)).unwrap_err();
    assert!(
        matches!(
            err,
            Error::MisalignedPrefix {
                tokens: 65,
                page_size: 64
            }
        ),
        "{err}"
    );
    // Also when an earlier request of the batch was fine.
    let err = a
        .alloc_batch(&[new_chain(2), extend(1, 100, 1)])
        .unwrap_err();
    assert!(matches!(err, Error::MisalignedPrefix { tokens: 100, .. }));
    assert_eq!(a, before);
}

#[test]
fn start_owner_outside_the_group_is_refused() {
    let mut a = alloc(2, 4);
    let err = a.alloc(extend(2, 0, 1)).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    assert_eq!(a.total_free(), 6);
}

#[test]
fn exhaustion_names_the_lowest_short_class_and_changes_nothing() {
    let mut a = alloc(2, 4); // 3 free per class
    let before = a.clone();
    // 7 pages from rank 0: 4 from class 0, 3 from class 1.
    let err = a.alloc(extend(0, 0, 7)).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Exhausted {
                owner: 0,
                needed: 4,
                free: 3
            }
        ),
        "{err}"
    );
    // Each request fits alone; together they need 4 from class 1.
    let err = a
        .alloc_batch(&[extend(1, 0, 3), extend(1, 0, 3)])
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Exhausted {
                owner: 1,
                needed: 4,
                free: 3
            }
        ),
        "{err}"
    );
    let err = a.alloc_matching(&lp(&[3, 5, 7, 9])).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Exhausted {
                owner: 1,
                needed: 4,
                free: 3
            }
        ),
        "{err}"
    );
    assert_eq!(a, before);
    assert!(a.alloc(extend(0, 0, 6)).is_ok());
    assert_eq!(a.admission_capacity(), 0);
}

#[test]
fn free_errors_change_nothing() {
    let mut a = alloc(2, 4); // logical pages 0..8, reserved 0 and 1
    let chain = a.alloc(new_chain(3)).unwrap().pages; // [2, 3, 4]
    assert_eq!(chain, lp(&[2, 3, 4]));
    a.free(&lp(&[3])).unwrap();
    let before = a.clone();
    type Case = (&'static [u64], fn(&Error) -> bool);
    let cases: [Case; 6] = [
        (&[2, 8], |e| {
            matches!(
                e,
                Error::OutOfRange {
                    index: 8,
                    limit: 8,
                    ..
                }
            )
        }),
        (&[2, 1], |e| {
            matches!(e, Error::ReservedPage { page: 1, shard: 2 })
        }),
        (&[2, 6], |e| matches!(e, Error::NeverAllocated { page: 6 })),
        (&[2, 3], |e| matches!(e, Error::DoubleFree { page: 3 })),
        (&[2, 4, 2], |e| matches!(e, Error::DoubleFree { page: 2 })),
        (&[u64::MAX], |e| matches!(e, Error::OutOfRange { .. })),
    ];
    for (pages, expected) in cases {
        let err = a.free(&lp(pages)).unwrap_err();
        assert!(expected(&err), "free {pages:?}: {err}");
        assert_eq!(a, before, "free {pages:?} changed the allocator");
    }
    a.free(&lp(&[2, 4])).unwrap();
    assert_eq!(a.total_free(), 6);
}

#[test]
fn matching_reserved_pages_is_refused() {
    let mut a = alloc(4, 3);
    let before = a.clone();
    let err = a.alloc_matching(&lp(&[5, 2])).unwrap_err();
    assert!(
        matches!(err, Error::ReservedPage { page: 2, shard: 4 }),
        "{err}"
    );
    assert_eq!(a, before);
    // Pages of a larger pool are fine: only the class matters. Lowest pages go first.
    let got = a.alloc_matching(&lp(&[1001, 6, 13])).unwrap();
    assert_eq!(got, lp(&[5, 6, 9]));
}

#[test]
fn construction_needs_a_real_page_per_rank() {
    let p = Placement::new(2).unwrap();
    assert!(matches!(
        ShardAllocator::new(p, 1),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        ShardAllocator::new(p, u64::MAX),
        Err(Error::InvalidArgument(_))
    ));
    let a = ShardAllocator::new(p, 2).unwrap();
    assert_eq!((a.placement(), a.pages_per_rank()), (p, 2));
    assert_eq!(a.total_free(), 2);
    assert!(!a.is_allocated(LogicalPage(0)) && !a.is_allocated(LogicalPage(u64::MAX)));
}

#[test]
fn empty_operations_succeed_and_change_nothing() {
    let mut a = alloc(3, 4);
    let before = a.clone();
    assert!(a.alloc_batch(&[]).unwrap().is_empty());
    assert!(a.alloc_matching(&[]).unwrap().is_empty());
    a.free(&[]).unwrap();
    let empty = a.alloc(extend(1, 128, 0)).unwrap();
    assert_eq!((empty.start_owner, empty.first_position), (1, 2));
    assert!(empty.pages.is_empty());
    assert_eq!(a, before);
}

// Extreme values: the public constructors and operations of the sharding math, the allocator,
// request chains, the memory budget and the two transfer planners, driven with 0, 1, u32::MAX,
// u64::MAX, usize::MAX and powers of two near overflow. Every call must return `Ok`
// with sizes consistent with its inputs, or `Err` leaving its state as it was (compared against
// a clone); none may panic (proptest reports a panic with the input that caused it).

mod edges {
    use kvshard::chain::RequestChain;
    use kvshard::geometry::{CacheGeometry, LatentLayout, PoolGeometry, PAGE_SIZE};
    use kvshard::hicache::{CacheNode, TransferPlan};
    use kvshard::index::{LocalPage, LogicalPage, Slot};
    use kvshard::pool::{Budget, BudgetRequest};
    use kvshard::shard::{AllocRequest, ChainStart, Placement, ShardAllocator};
    use kvshard::transfer::{ChunkRange, PoolLayout, PrefillRank, Registration, SendPlan};
    use proptest::prelude::*;

    const PAGE: u64 = PAGE_SIZE as u64;

    pub fn u64s() -> BoxedStrategy<u64> {
        prop_oneof![
            4 => prop::sample::select(vec![
                0,
                1,
                2,
                3,
                63,
                64,
                65,
                u64::from(u32::MAX),
                1 << 32,
                1 << 57,
                1 << 58,
                (1 << 63) - 1,
                1 << 63,
                u64::MAX / 64,
                u64::MAX / 64 + 1,
                u64::MAX - 63,
                u64::MAX - 1,
                u64::MAX,
            ]),
            2 => 0..256u64,
            1 => any::<u64>(),
        ]
        .boxed()
    }

    pub fn u32s() -> BoxedStrategy<u32> {
        prop_oneof![
            4 => prop::sample::select(vec![
                0,
                1,
                2,
                3,
                4,
                7,
                8,
                1 << 16,
                (1 << 31) - 1,
                1 << 31,
                u32::MAX - 1,
                u32::MAX,
            ]),
            2 => 0..16u32,
            1 => any::<u32>(),
        ]
        .boxed()
    }

    pub fn usizes() -> BoxedStrategy<usize> {
        prop_oneof![
            4 => prop::sample::select(vec![
                0,
                1,
                63,
                64,
                65,
                128,
                1 << 32,
                1 << 57,
                1 << 58,
                1 << 63,
                usize::MAX - 63,
                usize::MAX - 1,
                usize::MAX,
            ]),
            2 => 0..512usize,
            1 => any::<usize>(),
        ]
        .boxed()
    }

    pub fn geometries() -> Vec<CacheGeometry> {
        vec![
            CacheGeometry::with_draft(PoolGeometry::with_indexer_layers(
                LatentLayout::Fp8Trtllm,
                vec![true, false, true],
            )),
            CacheGeometry::target_only(PoolGeometry::new(LatentLayout::Bf16, 2)),
            CacheGeometry::with_draft(PoolGeometry::new(LatentLayout::Fp8Trtllm, 61)),
        ]
    }

    /// `a * b + c` without overflow, as u128.
    fn wide(a: u64, b: u64, c: u64) -> u128 {
        u128::from(a) * u128::from(b) + u128::from(c)
    }

    pub fn placement_math(
        shard: u32,
        rank: u32,
        page: u64,
        slot: u64,
        local: u64,
        physical: u64,
        offset: usize,
    ) -> Result<(), TestCaseError> {
        let Ok(p) = Placement::new(shard) else {
            prop_assert_eq!(shard, 0);
            return Ok(());
        };
        let n = u64::from(shard);
        prop_assert_eq!(p.shard(), shard);
        prop_assert_eq!(p.check_rank(rank).is_ok(), rank < shard);
        let owner = p.owner(LogicalPage(page));
        prop_assert!(owner < shard);
        let l = p.local(LogicalPage(page));
        prop_assert_eq!(wide(l.0, n, u64::from(owner)), u128::from(page));
        prop_assert_eq!(p.logical(owner, l), Some(LogicalPage(page)));
        prop_assert_eq!(p.is_reserved(LogicalPage(page)), page < n);
        match p.logical(rank, LocalPage(local)) {
            Some(back) => {
                prop_assert_eq!(u128::from(back.0), wide(local, n, u64::from(rank)));
                if rank < shard {
                    prop_assert_eq!((p.owner(back), p.local(back)), (rank, LocalPage(local)));
                }
            }
            None => prop_assert!(wide(local, n, u64::from(rank)) > u128::from(u64::MAX)),
        }
        let s = Slot(slot);
        let row = p.local_row(s);
        prop_assert!(p.slot_owner(s) < shard);
        prop_assert_eq!(row % PAGE, slot % PAGE);
        prop_assert_eq!(
            row / PAGE,
            p.local(s.page()).0,
            "row of slot {} on page {}",
            slot,
            s.page().0
        );
        match p.logical_pages(physical) {
            Ok(pages) => prop_assert_eq!(u128::from(pages), wide(physical, n, 0)),
            Err(_) => prop_assert!(wide(physical, n, 0) > u128::from(u64::MAX)),
        }
        match p.logical_capacity(physical) {
            Ok(slots) => prop_assert_eq!(u128::from(slots), wide(physical, n, 0) * 64),
            Err(_) => prop_assert!(wide(physical, n, 0) * 64 > u128::from(u64::MAX)),
        }
        match LogicalPage(page).slot(offset) {
            Some(s) => {
                prop_assert_eq!(u128::from(s.0), wide(page, PAGE, 0) + offset as u128);
                if offset < PAGE_SIZE {
                    prop_assert_eq!((s.page(), s.offset()), (LogicalPage(page), offset));
                }
            }
            None => prop_assert!(wide(page, PAGE, 0) + offset as u128 > u128::from(u64::MAX)),
        }
        Ok(())
    }

    /// Shard sizes and pages per rank an allocator is built with: small ones that succeed (or
    /// fail for too few pages), and extreme ones whose page-state table would take at least
    /// 2^58 bytes or overflow, so they must fail without allocating. (Products between those,
    /// e.g. `u32::MAX` ranks of 2 pages, are valid but allocate a byte per logical page: a
    /// resource limit, not something a property test may allocate.)
    pub fn allocator_config() -> BoxedStrategy<(u32, u64)> {
        prop_oneof![
            3 => (1..9u32, 0..40u64),
            1 => (
                u32s(),
                prop::sample::select(vec![1 << 58, 1 << 62, 1 << 63, u64::MAX - 1, u64::MAX])
            ),
            1 => (
                prop::sample::select(vec![1 << 31, u32::MAX - 1, u32::MAX]),
                prop::sample::select(vec![1 << 27, 1 << 32, u64::MAX / 64, u64::MAX])
            ),
        ]
        .boxed()
    }

    #[derive(Debug, Clone)]
    pub struct Req {
        /// `None`: a new chain; else (start owner, prefix tokens).
        pub extend: Option<(u32, usize)>,
        pub pages: usize,
    }

    fn reqs() -> impl Strategy<Value = Req> {
        let pages = prop_oneof![3 => 0..12usize, 1 => usizes()];
        (prop::option::of((u32s(), usizes())), pages)
            .prop_map(|(extend, pages)| Req { extend, pages })
    }

    #[derive(Debug, Clone)]
    pub enum Op {
        Alloc(Req),
        Batch(Vec<Req>),
        Matching(Vec<u64>),
        /// Frees the picked live pages, plus `extra` raw pages.
        Free {
            picks: Vec<usize>,
            extra: Vec<u64>,
        },
    }

    pub fn ops() -> impl Strategy<Value = Vec<Op>> {
        let op = prop_oneof![
            3 => reqs().prop_map(Op::Alloc),
            2 => prop::collection::vec(reqs(), 0..4).prop_map(Op::Batch),
            2 => prop::collection::vec(u64s(), 0..6).prop_map(Op::Matching),
            3 => (
                prop::collection::vec(any::<usize>(), 0..6),
                prop::collection::vec(u64s(), 0..2)
            )
                .prop_map(|(picks, extra)| Op::Free { picks, extra }),
        ];
        prop::collection::vec(op, 1..24)
    }

    fn request(req: &Req) -> AllocRequest {
        AllocRequest {
            chain: match req.extend {
                None => ChainStart::New,
                Some((start_owner, prefix_tokens)) => ChainStart::Extend {
                    start_owner,
                    prefix_tokens,
                },
            },
            pages: req.pages,
        }
    }

    fn check_allocation(
        a: &ShardAllocator,
        req: &Req,
        got: &kvshard::shard::Allocation,
    ) -> Result<(), TestCaseError> {
        let p = a.placement();
        let n = u128::from(p.shard());
        prop_assert_eq!(got.pages.len(), req.pages);
        match req.extend {
            Some((start_owner, prefix)) => {
                prop_assert_eq!(got.start_owner, start_owner);
                prop_assert_eq!(got.first_position, prefix / PAGE_SIZE);
            }
            None => {
                prop_assert!(got.start_owner < p.shard());
                prop_assert_eq!(got.first_position, 0);
            }
        }
        let limit = p.logical_pages(a.pages_per_rank()).unwrap();
        for (i, &page) in got.pages.iter().enumerate() {
            let owner = (u128::from(got.start_owner) + got.first_position as u128 + i as u128) % n;
            prop_assert_eq!(u128::from(p.owner(page)), owner, "position {}", i);
            prop_assert!(!p.is_reserved(page) && page.0 < limit);
            prop_assert!(a.is_allocated(page));
        }
        Ok(())
    }

    pub fn allocator_ops(shard: u32, ppr: u64, ops: Vec<Op>) -> Result<(), TestCaseError> {
        let Ok(placement) = Placement::new(shard) else {
            prop_assert_eq!(shard, 0);
            return Ok(());
        };
        let mut a = match ShardAllocator::new(placement, ppr) {
            Ok(a) => a,
            Err(_) => {
                let fits = u64::from(shard)
                    .checked_mul(ppr)
                    .is_some_and(|total| total < 1 << 58);
                prop_assert!(ppr < 2 || !fits, "refused {} pages x {} ranks", ppr, shard);
                return Ok(());
            }
        };
        prop_assert!(ppr >= 2);
        prop_assert_eq!(a.pages_per_rank(), ppr);
        let capacity = (u64::from(shard) * (ppr - 1)) as usize;
        prop_assert_eq!(a.total_free(), capacity);
        let mut live: Vec<LogicalPage> = Vec::new();
        for op in ops {
            let before = a.clone();
            let free_before = a.total_free();
            match op {
                Op::Alloc(req) => match a.alloc(request(&req)) {
                    Ok(got) => {
                        check_allocation(&a, &req, &got)?;
                        prop_assert_eq!(a.total_free() + got.pages.len(), free_before);
                        live.extend(got.pages);
                    }
                    Err(_) => prop_assert!(a == before, "a failed alloc changed the allocator"),
                },
                Op::Batch(reqs) => {
                    let requests: Vec<AllocRequest> = reqs.iter().map(request).collect();
                    match a.alloc_batch(&requests) {
                        Ok(got) => {
                            prop_assert_eq!(got.len(), reqs.len());
                            let mut taken = 0;
                            for (req, got) in reqs.iter().zip(got) {
                                check_allocation(&a, req, &got)?;
                                taken += got.pages.len();
                                live.extend(got.pages);
                            }
                            prop_assert_eq!(a.total_free() + taken, free_before);
                        }
                        Err(_) => {
                            prop_assert!(a == before, "a failed batch changed the allocator")
                        }
                    }
                }
                Op::Matching(raw) => {
                    let pages: Vec<LogicalPage> = raw.iter().map(|&p| LogicalPage(p)).collect();
                    match a.alloc_matching(&pages) {
                        Ok(got) => {
                            prop_assert_eq!(got.len(), pages.len());
                            for (g, p) in got.iter().zip(&pages) {
                                prop_assert_eq!(placement.owner(*g), placement.owner(*p));
                                prop_assert!(a.is_allocated(*g) && !placement.is_reserved(*g));
                            }
                            prop_assert_eq!(a.total_free() + got.len(), free_before);
                            live.extend(got);
                        }
                        Err(_) => {
                            prop_assert!(a == before, "a failed matching changed the allocator")
                        }
                    }
                }
                Op::Free { picks, extra } => {
                    let mut pages: Vec<LogicalPage> = Vec::new();
                    for pick in picks {
                        if !live.is_empty() {
                            pages.push(live[pick % live.len()]);
                        }
                    }
                    pages.extend(extra.iter().map(|&p| LogicalPage(p)));
                    match a.free(&pages) {
                        Ok(()) => {
                            for p in &pages {
                                prop_assert!(!a.is_allocated(*p));
                            }
                            prop_assert_eq!(a.total_free(), free_before + pages.len());
                            live.retain(|p| !pages.contains(p));
                        }
                        Err(_) => prop_assert!(a == before, "a failed free changed the allocator"),
                    }
                }
            }
            prop_assert_eq!(a.total_free() + live.len(), capacity);
        }
        Ok(())
    }

    #[derive(Debug, Clone)]
    pub enum ChainOp {
        Grow(usize),
        Slots(usize, usize),
        Node(u64, usize, usize),
        Register(u64, u64, usize),
        Cached(u32, Vec<u64>),
    }

    pub fn chain_ops() -> impl Strategy<Value = Vec<ChainOp>> {
        let small = || prop_oneof![3 => 0..300usize, 1 => usizes()];
        let op = prop_oneof![
            3 => small().prop_map(ChainOp::Grow),
            2 => (small(), small()).prop_map(|(a, b)| ChainOp::Slots(a, b)),
            2 => (any::<u64>(), 0..8usize, small()).prop_map(|(id, a, b)| ChainOp::Node(id, a, b)),
            2 => (any::<u64>(), u64s(), prop_oneof![3 => 0..4usize, 1 => usizes()])
                .prop_map(|(r, p, x)| ChainOp::Register(r, p, x)),
            1 => (u32s(), prop::collection::vec(u64s(), 0..5)).prop_map(|(s, p)| ChainOp::Cached(s, p)),
        ];
        prop::collection::vec(op, 1..16)
    }

    pub fn chain_ops_run(shard: u32, ppr: u64, ops: Vec<ChainOp>) -> Result<(), TestCaseError> {
        let placement = Placement::new(shard).unwrap();
        let mut alloc = ShardAllocator::new(placement, ppr).unwrap();
        let mut host = ShardAllocator::new(placement, ppr).unwrap();
        let mut chain = RequestChain::new(placement);
        let g = geometries().remove(0);
        for op in ops {
            match op {
                ChainOp::Grow(tokens) => {
                    let (chain_before, alloc_before) = (chain.clone(), alloc.clone());
                    let had = chain.page_count();
                    match chain.grow_to(&mut alloc, tokens) {
                        Ok(new) => {
                            let want = tokens.div_ceil(PAGE_SIZE).saturating_sub(had);
                            prop_assert_eq!(new.len(), want);
                            prop_assert!(chain.capacity() >= tokens);
                            let b = chain.start_owner().unwrap_or(0);
                            for (i, &page) in chain.pages().unwrap().iter().enumerate() {
                                let owner = (u64::from(b) + i as u64) % u64::from(shard);
                                prop_assert_eq!(u64::from(placement.owner(page)), owner);
                                prop_assert!(alloc.is_allocated(page));
                            }
                        }
                        Err(_) => {
                            prop_assert!(chain == chain_before && alloc == alloc_before);
                        }
                    }
                }
                ChainOp::Slots(a, b) => match chain.slots(a..b) {
                    Ok(slots) => {
                        prop_assert_eq!(slots.len(), b - a);
                        for (t, s) in (a..b).zip(&slots) {
                            prop_assert_eq!(s.page(), chain.pages().unwrap()[t / PAGE_SIZE]);
                            prop_assert_eq!(s.offset(), t % PAGE_SIZE);
                        }
                    }
                    Err(_) => prop_assert!(a > b || b > chain.capacity()),
                },
                ChainOp::Node(id, a, b) => match CacheNode::of_chain(&chain, id, a..b) {
                    Ok(node) => {
                        prop_assert_eq!(&node.device_pages[..], &chain.pages().unwrap()[a..b]);
                        prop_assert_eq!(node.id, id);
                        // Sharded nodes carry their first page's owner (none before the chain's first page).
                        prop_assert_eq!(
                            node.start_owner.is_some(),
                            shard > 1 && chain.start_owner().is_some()
                        );
                        let before = host.clone();
                        match node.alloc_host_pages(&mut host) {
                            Ok(pages) => {
                                prop_assert_eq!(pages.len(), node.device_pages.len());
                                for (h, d) in pages.iter().zip(&node.device_pages) {
                                    prop_assert_eq!(placement.owner(*h), placement.owner(*d));
                                    prop_assert!(host.is_allocated(*h));
                                }
                                host.free(&pages).unwrap();
                            }
                            Err(_) => prop_assert!(host == before),
                        }
                    }
                    Err(_) => prop_assert!(a > b || b > chain.page_count()),
                },
                ChainOp::Register(request, pages, prefix) => {
                    let layout = PoolLayout::packed(g.clone(), pages);
                    match Registration::of_chain(&chain, request, layout, prefix) {
                        Ok(reg) => {
                            prop_assert_eq!(shard, 1);
                            prop_assert_eq!(reg.request, request);
                            prop_assert_eq!(reg.prefix_pages, prefix);
                            prop_assert_eq!(reg.pages.len() + prefix, chain.page_count());
                            prop_assert_eq!(reg.state_pages.len(), chain.page_count());
                            prop_assert!(reg.validate().is_ok());
                        }
                        Err(_) => prop_assert!(
                            shard != 1
                                || prefix > chain.page_count()
                                || chain.pages().unwrap().iter().any(|p| p.0 >= pages)
                        ),
                    }
                }
                ChainOp::Cached(start_owner, pages) => {
                    let pages: Vec<LogicalPage> = pages.into_iter().map(LogicalPage).collect();
                    if let Ok(cached) = RequestChain::cached(&alloc, start_owner, pages.clone()) {
                        prop_assert_eq!(cached.start_owner(), Some(start_owner));
                        prop_assert_eq!(cached.pages().unwrap(), &pages[..]);
                        for (i, &page) in pages.iter().enumerate() {
                            let owner = (u64::from(start_owner) + i as u64) % u64::from(shard);
                            prop_assert_eq!(u64::from(placement.owner(page)), owner);
                            prop_assert!(alloc.is_allocated(page));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    pub fn budget(req: BudgetRequest, geometry: usize, shard: u32) -> Result<(), TestCaseError> {
        let Ok(placement) = Placement::new(shard) else {
            return Ok(());
        };
        let g = &geometries()[geometry];
        let copy = req.clone();
        let got = Budget::plan(&req, g, placement);
        prop_assert_eq!(&req, &copy);
        let Ok(b) = got else {
            return Ok(());
        };
        prop_assert!(req.contexts > 0 && req.context_len > 0 && req.chunk_size > 0);
        let page_bytes = g.page_bytes() as u64;
        prop_assert_eq!(b.page_bytes, page_bytes);
        prop_assert!(b.pages >= 2);
        prop_assert_eq!(
            u128::from(b.pool_bytes),
            u128::from(b.pages) * u128::from(page_bytes)
        );
        prop_assert!(
            u128::from(b.scratch_bytes) + u128::from(b.pool_bytes) <= u128::from(req.bytes)
        );
        prop_assert!(
            req.bytes - b.scratch_bytes - b.pool_bytes < page_bytes,
            "a whole page left over"
        );
        prop_assert_eq!(
            u128::from(b.logical_capacity),
            u128::from(b.pages) * u128::from(shard) * 64
        );
        if shard == 1 {
            prop_assert_eq!(
                (b.scratch_rows, b.scratch_bytes, b.max_prefix_tokens),
                (0, 0, 0)
            );
        } else {
            let stride = u128::from(shard) * 64;
            let context = u128::from(req.context_len).div_ceil(stride) * stride;
            prop_assert_eq!(
                u128::from(b.max_prefix_tokens),
                context * u128::from(req.contexts)
            );
            let chunk = u128::from(req.chunk_size).div_ceil(64) * 64;
            prop_assert_eq!(
                u128::from(b.scratch_rows),
                u128::from(b.max_prefix_tokens) + chunk + 64
            );
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub fn transfer_plan(
        shard: u32,
        rank: u32,
        device: Vec<u64>,
        host: Vec<u64>,
        device_pages: u64,
        host_pages: u64,
    ) -> Result<(), TestCaseError> {
        let Ok(placement) = Placement::new(shard) else {
            return Ok(());
        };
        let device: Vec<LogicalPage> = device.into_iter().map(LogicalPage).collect();
        let host: Vec<LogicalPage> = host.into_iter().map(LogicalPage).collect();
        let Ok(plan) = TransferPlan::new(placement, rank, &device, &host, device_pages, host_pages)
        else {
            return Ok(());
        };
        prop_assert!(rank < shard && device.len() == host.len());
        prop_assert_eq!(plan.requested(), device.len());
        prop_assert!(plan.len() <= plan.requested());
        prop_assert!(plan.positions().windows(2).all(|w| w[0] < w[1]));
        prop_assert_eq!(
            plan.runs().iter().map(|r| r.pages).sum::<u64>(),
            plan.len() as u64
        );
        for (k, &i) in plan.positions().iter().enumerate() {
            prop_assert_eq!(placement.owner(device[i]), rank);
            prop_assert_eq!(plan.device_pages()[k], placement.local(device[i]));
            prop_assert_eq!(plan.host_pages()[k], placement.local(host[i]));
            prop_assert!(plan.device_pages()[k].0 < device_pages);
            prop_assert!(plan.host_pages()[k].0 < host_pages);
        }
        Ok(())
    }

    /// A send plan's inputs: coherent ones (most of them plan), then one field replaced by an
    /// extreme value.
    #[derive(Debug, Clone)]
    pub struct SendCase {
        pub source: PrefillRank,
        pub src_pages: Vec<LogicalPage>,
        pub registration: Registration,
        pub chunk: ChunkRange,
    }

    fn coherent() -> impl Strategy<Value = SendCase> {
        (
            1..5u32,
            0..5u32,
            2..64u64,
            0..4usize,
            1..10usize,
            any::<bool>(),
            0..1000u64,
        )
            .prop_flat_map(|(shard, rank, src_pages, prefix, seq, last, seed)| {
                let rank = rank % shard;
                let logical = u64::from(shard) * src_pages;
                let prefix = prefix.min(seq);
                (
                    prop::collection::vec(u64::from(shard)..logical, seq),
                    Just((shard, rank, src_pages, prefix, seq, last, seed)),
                    0..=seq,
                    0..64usize,
                )
            })
            .prop_map(
                |(src, (shard, rank, src_pages, prefix, seq, last, seed), start, extra)| {
                    let g = geometries().remove(0);
                    // Distinct decode pages 1..=seq, rotated by the seed.
                    let dst: Vec<LocalPage> = (0..seq as u64)
                        .map(|i| LocalPage(1 + (i + seed) % seq as u64))
                        .collect();
                    let start = start.max(prefix).min(seq);
                    let end = if last {
                        (seq - 1) * PAGE_SIZE + 1 + extra.min(63)
                    } else {
                        seq * PAGE_SIZE
                    };
                    SendCase {
                        source: PrefillRank {
                            placement: Placement::new(shard).unwrap(),
                            rank,
                            layout: PoolLayout::packed(g.clone(), src_pages),
                        },
                        src_pages: src.into_iter().map(LogicalPage).collect(),
                        registration: Registration {
                            request: seed,
                            layout: PoolLayout::packed(g, seq as u64 + 1),
                            prefix_pages: prefix,
                            pages: dst[prefix..].to_vec(),
                            state_pages: dst,
                        },
                        chunk: ChunkRange {
                            index: 0,
                            start: start * PAGE_SIZE,
                            end,
                            last,
                        },
                    }
                },
            )
    }

    /// Coherent cases with one field made extreme (`huge`: a source or decode pool too large
    /// for its byte offsets to fit 64 bits, with its top pages really used).
    pub fn send_cases(huge: bool) -> impl Strategy<Value = SendCase> {
        let fields = if huge { 10..12usize } else { 0..10usize };
        (coherent(), fields, u64s(), usizes(), u32s()).prop_map(|(mut c, field, v, z, w)| {
            match field {
                0 => c.source.layout.pages = v,
                1 => c.registration.layout.pages = v,
                2 => c.registration.prefix_pages = z,
                3 => c.chunk.start = z,
                4 => c.chunk.end = z,
                5 => c.source.rank = w,
                6 => c.source.placement = Placement::new(w.max(1)).unwrap(),
                7 => {
                    if let Some(p) = c.src_pages.first_mut() {
                        *p = LogicalPage(v)
                    }
                }
                8 => {
                    if let Some(p) = c.registration.pages.last_mut() {
                        *p = LocalPage(v)
                    }
                }
                9 => c.chunk.start = z.checked_next_multiple_of(64).unwrap_or(usize::MAX - 63),
                10 => {
                    c.source.layout.pages = v;
                    let top = u64::from(c.source.placement.shard()).saturating_mul(v);
                    for (i, p) in c.src_pages.iter_mut().enumerate() {
                        *p = LogicalPage(top.saturating_sub(1 + i as u64));
                    }
                }
                11 => {
                    c.registration.layout.pages = v;
                    if let Some(p) = c.registration.pages.last_mut() {
                        *p = LocalPage(v.saturating_sub(1));
                    }
                }
                _ => {}
            }
            c
        })
    }

    pub fn send_plan(case: SendCase) -> Result<(), TestCaseError> {
        let copy = case.clone();
        let got = SendPlan::new(
            &case.source,
            &case.src_pages,
            &case.registration,
            case.chunk,
        );
        prop_assert_eq!(&case.source, &copy.source);
        prop_assert_eq!(&case.registration, &copy.registration);
        let Ok(plan) = got else {
            return Ok(());
        };
        let (reg, chunk) = (&case.registration, case.chunk);
        let registered = reg.prefix_pages + reg.pages.len();
        let kv = plan.kv().positions();
        prop_assert_eq!(kv.start, chunk.start / PAGE_SIZE);
        prop_assert!(kv.start >= reg.prefix_pages && kv.end <= registered);
        prop_assert!(plan.kv().owned_pages() <= kv.len());
        if chunk.last {
            prop_assert_eq!(kv.end, chunk.end.div_ceil(PAGE_SIZE));
            prop_assert_eq!(plan.state().positions().len(), reg.state_pages.len());
        } else {
            prop_assert!(plan.state().runs().is_empty());
        }
        let src_limit = case.source.layout.pages;
        for section in plan.sections() {
            prop_assert_eq!(
                section.runs().iter().map(|r| r.pages).sum::<u64>(),
                section.owned_pages() as u64
            );
            for (&s, &d) in section
                .owned()
                .src_pages()
                .iter()
                .zip(section.owned().dst_pages())
            {
                prop_assert!(s.0 < src_limit, "source {} of {} pages", s.0, src_limit);
                prop_assert!(d.0 >= 1 && d.0 < reg.layout.pages);
            }
        }
        // Descriptors: per section, component, layer and run, offsets are the run's pages
        // times the block, never wrapped, inside both pools.
        let mut expected = Vec::new();
        for section in plan.sections() {
            for c in section.components() {
                for layer in 0..c.layers {
                    for run in section.runs() {
                        let item = u128::from(c.item);
                        expected.push((
                            c.component,
                            layer,
                            u128::from(run.src.0) * item,
                            u128::from(run.dst.0) * item,
                            u128::from(run.pages) * item,
                        ));
                    }
                }
            }
        }
        let got: Vec<_> = plan
            .descriptors()
            .map(|d| {
                (
                    d.component,
                    d.layer,
                    u128::from(d.src_offset),
                    u128::from(d.dst_offset),
                    u128::from(d.bytes),
                )
            })
            .collect();
        prop_assert_eq!(&got, &expected);
        prop_assert_eq!(got.len(), plan.descriptor_count());
        let item_of = |d: &(kvshard::geometry::Component, usize, u128, u128, u128)| {
            u128::from(g_item(&plan, d.0))
        };
        for d in &got {
            prop_assert!(
                d.2 + d.4 <= u128::from(src_limit) * item_of(d),
                "past the source: {:?}",
                d
            );
            prop_assert!(
                d.3 + d.4 <= u128::from(reg.layout.pages) * item_of(d),
                "past the decode pool: {:?}",
                d
            );
        }
        let total: u128 = got.iter().map(|d| d.4).sum();
        prop_assert_eq!(total, u128::from(plan.bytes().total()));
        Ok(())
    }

    fn g_item(plan: &SendPlan, component: kvshard::geometry::Component) -> u64 {
        plan.sections()
            .iter()
            .flat_map(|s| s.components())
            .find(|c| c.component == component)
            .map_or(1, |c| c.item)
    }
}

proptest! {
    #[test]
    fn placement_math_is_total_on_extreme_values(
        shard in edges::u32s(),
        rank in edges::u32s(),
        page in edges::u64s(),
        slot in edges::u64s(),
        local in edges::u64s(),
        physical in edges::u64s(),
        offset in edges::usizes(),
    ) {
        edges::placement_math(shard, rank, page, slot, local, physical, offset)?;
    }

    #[test]
    fn allocator_operations_on_extreme_values_succeed_consistently_or_change_nothing(
        (shard, ppr) in edges::allocator_config(),
        ops in edges::ops(),
    ) {
        edges::allocator_ops(shard, ppr, ops)?;
    }

    #[test]
    fn request_chains_on_extreme_values_succeed_consistently_or_change_nothing(
        shard in prop_oneof![Just(1u32), 2..6u32],
        ppr in 2..12u64,
        ops in edges::chain_ops(),
    ) {
        edges::chain_ops_run(shard, ppr, ops)?;
    }

    #[test]
    fn budgets_of_extreme_requests_are_consistent_or_refused(
        bytes in edges::u64s(),
        context_len in edges::u64s(),
        chunk_size in edges::u64s(),
        contexts in edges::u64s(),
        geometry in 0..3usize,
        shard in edges::u32s(),
    ) {
        let req = kvshard::pool::BudgetRequest { bytes, context_len, chunk_size, contexts };
        edges::budget(req, geometry, shard)?;
    }

    #[test]
    fn budgets_of_realistic_requests_are_consistent(
        gib in 1..200u64,
        context_len in 1..(1u64 << 20),
        chunk_size in 1..20_000u64,
        contexts in 0..16u64,
        geometry in 0..3usize,
        shard in 1..9u32,
    ) {
        let req = kvshard::pool::BudgetRequest { bytes: gib << 30, context_len, chunk_size, contexts };
        edges::budget(req, geometry, shard)?;
    }

    #[test]
    fn transfer_plans_of_extreme_pages_are_consistent_or_refused(
        shard in edges::u32s(),
        rank in edges::u32s(),
        device in prop::collection::vec(edges::u64s(), 0..8),
        host in prop::collection::vec(edges::u64s(), 0..8),
        device_pages in edges::u64s(),
        host_pages in edges::u64s(),
    ) {
        edges::transfer_plan(shard, rank, device, host, device_pages, host_pages)?;
    }

    #[test]
    fn transfer_plans_of_valid_pages_are_consistent(
        shard in 1..6u32,
        rank in 0..6u32,
        pairs in prop::collection::vec((0..64u64, 0..64u64), 0..12),
    ) {
        // Device and host pages of one owner each, possibly repeated (then refused).
        let n = u64::from(shard);
        let device: Vec<u64> = pairs.iter().map(|&(d, _)| n + d).collect();
        let host: Vec<u64> = pairs.iter().map(|&(d, h)| n + h * n + d % n).collect();
        edges::transfer_plan(shard, rank, device, host, 64, 128)?;
    }

    #[test]
    fn send_plans_of_extreme_inputs_are_consistent_or_refused(case in edges::send_cases(false)) {
        edges::send_plan(case)?;
    }

    /// Finds a library bug: `SendPlan::new` accepts a pool layout whose byte offsets overflow
    /// 64 bits (e.g. a prefill pool of `u64::MAX` pages whose last page is used), and
    /// `SendPlan::descriptors` then computes `run.src.0 * c.item` (src/transfer/plan.rs) with
    /// wrapping arithmetic in release builds (an overflow panic in debug builds).
    #[test]
    fn send_plans_of_pools_too_large_to_address_are_refused(case in edges::send_cases(true)) {
        edges::send_plan(case)?;
    }
}

// Admission (docs/design.md, "Prefill") and budgets: what the allocator and the scratch take.
proptest! {
    // Old behaviour: `Admission::offer` floored a continuing chunk to whole pages of its own,
    // so a request whose cached prefix ended inside a page (a token-granular match) was left
    // with a prefix of no whole pages, and the allocator refused to extend its chain after it
    // (`MisalignedPrefix`). A continuing chunk now ends on a page boundary of the request.
    #[test]
    fn a_continuing_chunk_leaves_a_prefix_the_allocator_extends(
        shard in 1..9u32,
        prefix_len in 0..4096u64,
        extend_len in 1..20_000u64,
        chunk_tokens in 0..8192u64,
        earlier in 0..4u64,
    ) {
        use kvshard::shard::{Admission, AdmissionLimits, Candidate, Decision};
        let placement = Placement::new(shard).unwrap();
        let limits = AdmissionLimits { max_prefix_tokens: u64::MAX, chunk_tokens };
        let mut pass = Admission::new(placement, limits, u64::MAX);
        // Earlier requests of the pass take some of the chunk region.
        let _ = pass.offer(Candidate { prefix_len: 0, extend_len: earlier * 64 });
        let taken = pass.chunk_pages();
        let Ok(Decision::Admit { extend_len: chunk, last: false }) =
            pass.offer(Candidate { prefix_len, extend_len })
        else {
            return Ok(());
        };
        let next = prefix_len + chunk;
        prop_assert_eq!(next % 64, 0, "the next prefix is whole pages");
        prop_assert!(chunk > 0 && chunk < extend_len);
        prop_assert!(pass.chunk_pages() * 64 <= chunk_tokens);
        // As many chunk pages as the room held: no shorter continuing chunk than needed.
        prop_assert_eq!(pass.chunk_pages() - taken, (chunk_tokens / 64).saturating_sub(taken));
        let mut alloc = ShardAllocator::new(placement, 1024).unwrap();
        let prefix = alloc
            .alloc(AllocRequest { chain: ChainStart::New, pages: (next / 64) as usize })
            .unwrap();
        let extended = alloc.alloc(AllocRequest {
            chain: ChainStart::Extend {
                start_owner: prefix.start_owner,
                prefix_tokens: next as usize,
            },
            pages: 1,
        });
        prop_assert!(extended.is_ok(), "{:?}", extended);
    }

    // Old behaviour: a 0-token context and a 0-token chunk were planned; now they are refused
    // with the typed error, as 0 contexts per batch is, at every shard size and whatever else
    // the request says.
    #[test]
    fn budgets_that_size_nothing_are_refused_with_the_typed_error(
        bytes in edges::u64s(),
        context_len in edges::u64s(),
        chunk_size in edges::u64s(),
        contexts in edges::u64s(),
        zero in 0..3usize,
        shard in 1..9u32,
    ) {
        let mut req = kvshard::pool::BudgetRequest { bytes, context_len, chunk_size, contexts };
        match zero {
            0 => req.context_len = 0,
            1 => req.chunk_size = 0,
            _ => req.contexts = 0,
        }
        let g = kvshard::geometry::CacheGeometry::with_draft(kvshard::geometry::PoolGeometry::new(
            kvshard::geometry::LatentLayout::Fp8Trtllm,
            61,
        ));
        let e = kvshard::pool::Budget::plan(&req, &g, Placement::new(shard).unwrap()).unwrap_err();
        prop_assert!(matches!(e, Error::OutOfBounds { .. }), "{}", e);
    }
}
