//! A request chain belongs to its allocator: it keeps the allocator's identity and the
//! generation of every page it took, and a stale chain (a page freed since, maybe handed to
//! another request), a chain used with another allocator, and pages no allocator handed out are
//! refused with typed errors before anything touches memory (docs/design.md, "Ownership").

use std::sync::Arc;

use kvshard::backend::cpu::CpuBackend;
use kvshard::backend::Backend;
use kvshard::chain::RequestChain;
use kvshard::geometry::{CacheGeometry, LatentLayout, PoolGeometry};
use kvshard::hicache::CacheNode;
use kvshard::index::LogicalPage;
use kvshard::pool::{ChunkStaging, DevicePool, OwnedRowWrite};
use kvshard::shard::{Placement, ShardAllocator};
use kvshard::transfer::{PoolLayout, Registration};
use kvshard::Error;

fn cp2() -> Placement {
    Placement::new(2).unwrap()
}

/// A chain of `tokens` tokens grown through `alloc`.
fn grown(alloc: &mut ShardAllocator, tokens: usize) -> RequestChain {
    let mut chain = RequestChain::new(alloc.placement());
    chain.grow_to(alloc, tokens).unwrap();
    chain
}

/// Whether `result` is the stale-chain error for `page` at chain position `position`.
fn is_stale<T>(result: &Result<T, Error>, page: LogicalPage, position: usize) -> bool {
    matches!(result, Err(Error::StaleChain { page: p, position: at, .. }) if *p == page.0 && *at == position)
}

#[test]
fn a_freed_chain_hands_out_no_slots_pages_node_or_registration() {
    let mut alloc = ShardAllocator::new(Placement::unsharded(), 8).unwrap();
    let chain = grown(&mut alloc, 200);
    let copy = chain.clone();
    let pages = chain.pages().unwrap().to_vec();
    chain.free(&mut alloc).unwrap();
    assert!(pages.iter().all(|&p| !alloc.is_allocated(p)));

    assert!(is_stale(&chain.slots(0..10), pages[0], 0));
    assert!(is_stale(&chain.slots(130..150), pages[2], 2));
    assert!(is_stale(&chain.pages(), pages[0], 0));
    assert!(is_stale(&CacheNode::of_chain(&chain, 1, 1..3), pages[1], 1));
    let g = CacheGeometry::with_draft(PoolGeometry::new(LatentLayout::Fp8Trtllm, 2));
    let layout = PoolLayout::packed(g, 8);
    assert!(is_stale(
        &Registration::of_chain(&chain, 3, layout, 0),
        pages[0],
        0
    ));
    // A copy of the chain is as stale: the pages are gone for every holder.
    assert!(is_stale(&copy.slots(0..10), pages[0], 0));
    // What hands out no page still answers.
    assert_eq!((chain.page_count(), chain.capacity()), (4, 256));
    // An empty range touches no page: nothing to refuse.
    assert!(chain.slots(64..64).unwrap().is_empty());
}

#[test]
fn writes_through_a_stale_chain_are_refused_and_the_other_request_keeps_its_rows() {
    let cpu = CpuBackend::new();
    let b: Arc<dyn Backend> = Arc::new(cpu.new_stream());
    let g = CacheGeometry::with_draft(PoolGeometry::new(LatentLayout::Fp8Trtllm, 2));
    let placement = Placement::unsharded();
    // Two pages besides the padding page: the second request must reuse the first's pages.
    let pool = Arc::new(DevicePool::allocate(b.as_ref(), &g, placement, 0, 3).unwrap());
    let staging = Arc::new(ChunkStaging::new(b.as_ref(), &pool, 128).unwrap());
    let write =
        OwnedRowWrite::prepare_sync(b.as_ref(), staging.clone(), pool.clone(), |_| true).unwrap();
    let mut alloc = ShardAllocator::new(placement, 3).unwrap();

    let stale = grown(&mut alloc, 128);
    let stale_pages = stale.pages().unwrap().to_vec();
    stale.free(&mut alloc).unwrap();
    let other = grown(&mut alloc, 128);
    assert_eq!(
        other.pages().unwrap(),
        &stale_pages[..],
        "the pages were reused"
    );

    let fill = |byte: u8| {
        b.write_sync(staging.buffer(), 0, &vec![byte; staging.buffer().len()])
            .unwrap()
    };
    fill(0x5a);
    let slots = other.slots(0..128).unwrap();
    write
        .run_checked_sync(b.as_ref(), &slots, write.launch(b.as_ref(), 128))
        .unwrap();
    let before = pool.snapshot_sync(b.as_ref()).unwrap();

    // The stale chain's chunk: its slots are refused, so its write never runs.
    fill(0xa5);
    let refused = stale.slots(0..128);
    assert!(is_stale(&refused, stale_pages[0], 0), "{refused:?}");
    assert_eq!(pool.snapshot_sync(b.as_ref()).unwrap(), before);
}

#[test]
fn freeing_a_stale_chain_is_refused_and_the_other_request_keeps_its_pages() {
    let mut alloc = ShardAllocator::new(cp2(), 3).unwrap();
    let stale = grown(&mut alloc, 256);
    let stale_pages = stale.pages().unwrap().to_vec();
    stale.free(&mut alloc).unwrap();
    // A second free of the chain, before any reuse, is stale too.
    assert!(is_stale(&stale.free(&mut alloc), stale_pages[0], 0));
    // The raw pages' double free is refused as before.
    assert!(matches!(
        alloc.free(&stale_pages),
        Err(Error::DoubleFree { .. })
    ));

    let other = grown(&mut alloc, 256);
    assert_eq!(
        other.pages().unwrap(),
        &stale_pages[..],
        "the pages were reused"
    );
    let before = alloc.clone();
    let freed = stale.free(&mut alloc);
    assert!(is_stale(&freed, stale_pages[0], 0), "{freed:?}");
    assert_eq!(alloc, before);
    assert!(other
        .pages()
        .unwrap()
        .iter()
        .all(|&p| alloc.is_allocated(p)));
    other.free(&mut alloc).unwrap();
    assert_eq!(alloc.total_free(), 4);
}

#[test]
fn growing_or_freeing_through_another_allocator_is_refused() {
    let mut alloc = ShardAllocator::new(cp2(), 8).unwrap();
    // Another pool of the same placement, and a replica (a clone) of the chain's allocator.
    let mut other = ShardAllocator::new(cp2(), 8).unwrap();
    let mut replica = alloc.clone();
    let mut chain = grown(&mut alloc, 100);
    let (chain_before, other_before) = (chain.clone(), other.clone());

    for foreign in [&mut other, &mut replica] {
        let grew = chain.grow_to(foreign, 300).map(<[LogicalPage]>::to_vec);
        assert!(
            matches!(grew, Err(Error::ForeignAllocator { .. })),
            "{grew:?}"
        );
        assert!(matches!(
            chain.free(foreign),
            Err(Error::ForeignAllocator { .. })
        ));
    }
    assert_eq!(chain, chain_before);
    assert_eq!(other, other_before);
    assert!(chain
        .pages()
        .unwrap()
        .iter()
        .all(|&p| alloc.is_allocated(p)));
    // The replica still hands out what the original does, to chains of its own.
    let mut original = alloc.clone();
    assert_eq!(
        grown(&mut replica, 100).pages().unwrap(),
        chain.pages().unwrap()
    );
    assert_eq!(
        grown(&mut original, 64).pages().unwrap(),
        grown(&mut alloc, 64).pages().unwrap()
    );
    chain.grow_to(&mut alloc, 300).unwrap();
}

#[test]
fn a_cached_chain_takes_only_pages_its_allocator_holds() {
    let mut alloc = ShardAllocator::new(cp2(), 8).unwrap();
    let mut other = ShardAllocator::new(cp2(), 8).unwrap();
    // Pages never handed out.
    let never = RequestChain::cached(&alloc, 0, vec![LogicalPage(2), LogicalPage(3)]);
    assert!(
        matches!(never, Err(Error::NotAllocated { page: 2 })),
        "{never:?}"
    );
    // Pages another allocator handed out.
    let theirs = grown(&mut other, 128).pages().unwrap().to_vec();
    let start = cp2().owner(theirs[0]);
    assert!(matches!(
        RequestChain::cached(&alloc, start, theirs.clone()),
        Err(Error::NotAllocated { .. })
    ));
    // The padding page and a page beyond the allocator.
    assert!(matches!(
        RequestChain::cached(&alloc, 0, vec![LogicalPage(0)]),
        Err(Error::ReservedPage { page: 0, .. })
    ));
    assert!(matches!(
        RequestChain::cached(&alloc, 0, vec![LogicalPage(1000)]),
        Err(Error::OutOfRange { .. })
    ));

    // Pages it holds: taken, and stale once freed.
    let chain = grown(&mut alloc, 256);
    let pages = chain.pages().unwrap().to_vec();
    let start = chain.start_owner().unwrap();
    let cached = RequestChain::cached(&alloc, start, pages[..2].to_vec()).unwrap();
    assert_eq!(cached.slots(0..128).unwrap(), chain.slots(0..128).unwrap());
    chain.free(&mut alloc).unwrap();
    assert!(matches!(
        RequestChain::cached(&alloc, start, pages.clone()),
        Err(Error::NotAllocated { .. })
    ));
    assert!(is_stale(&cached.slots(0..1), pages[0], 0));

    // One page at two positions: they would write each other's rows.
    let mut unsharded = ShardAllocator::new(Placement::unsharded(), 4).unwrap();
    let page = grown(&mut unsharded, 1).pages().unwrap()[0];
    let twice = RequestChain::cached(&unsharded, 0, vec![page, page]);
    assert!(
        matches!(
            twice,
            Err(Error::DuplicatePage {
                first: 0,
                second: 1,
                ..
            })
        ),
        "{twice:?}"
    );
}

#[test]
fn a_request_continuing_a_freed_chain_is_refused() {
    // One page per owner class: whatever is freed is what comes out next.
    let mut alloc = ShardAllocator::new(cp2(), 2).unwrap();
    // Request 1 prefills a chunk, then is freed (finished, or evicted).
    let mut request1 = grown(&mut alloc, 128);
    let freed = request1.pages().unwrap().to_vec();
    request1.free(&mut alloc).unwrap();
    // Request 2 gets the same pages, as the allocator hands freed pages back lowest first.
    let request2 = grown(&mut alloc, 128);
    assert_eq!(request2.pages().unwrap(), &freed[..]);

    // Request 2's engine mistakenly continues request 1's chain: refused, nothing changes.
    let before = (request1.clone(), alloc.clone());
    let grew = request1
        .grow_to(&mut alloc, 256)
        .map(<[LogicalPage]>::to_vec);
    assert!(is_stale(&grew, freed[0], 0), "{grew:?}");
    // Even a growth that needs no new page is refused: the chain holds no page of its own.
    let same = request1
        .grow_to(&mut alloc, 64)
        .map(<[LogicalPage]>::to_vec);
    assert!(is_stale(&same, freed[0], 0), "{same:?}");
    assert_eq!((request1, alloc.clone()), before);
    // Request 2's own chain is current.
    assert_eq!(request2.slots(0..128).unwrap().len(), 128);
    request2.free(&mut alloc).unwrap();
}
