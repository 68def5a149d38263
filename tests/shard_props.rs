//! The rotated-owner allocator against a model: random sequences of batches (new chains and
//! extensions of live ones), tail frees, matching allocations and bad frees, with the model
//! predicting every start owner and every exhaustion by counting chain positions one by one
//! (not with the allocator's closed form). After every step the invariants of DOMAIN.md
//! section 3 are checked; a failed step must leave the allocator equal to its snapshot.

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
