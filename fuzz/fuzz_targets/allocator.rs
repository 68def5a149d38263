//! Operation sequences on the rotated-owner allocator: whatever the sequence, no call panics, a
//! failed call changes nothing, no page is ever handed out twice, and free counts add up.
#![no_main]

use std::collections::HashSet;

use arbitrary::Arbitrary;
use kvshard::index::LogicalPage;
use kvshard::shard::{AllocRequest, ChainStart, Placement, ShardAllocator};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
enum Op {
    New { pages: u16 },
    Extend { start_owner: u32, prefix_tokens: u32, pages: u16 },
    Batch(Vec<(bool, u32, u16)>),
    Matching(Vec<u64>),
    FreeSome { every: u8, offset: u8 },
    FreeRaw(Vec<u64>),
}

#[derive(Debug, Arbitrary)]
struct Input {
    shard: u8,
    pages_per_rank: u16,
    ops: Vec<Op>,
}

fuzz_target!(|input: Input| {
    let Ok(placement) = Placement::new(u32::from(input.shard % 9)) else {
        return;
    };
    let Ok(mut alloc) = ShardAllocator::new(placement, u64::from(input.pages_per_rank % 512)) else {
        return;
    };
    let total = alloc.total_free();
    let mut held: Vec<LogicalPage> = Vec::new();
    for op in input.ops.into_iter().take(64) {
        let before = alloc.clone();
        let result: Result<Vec<LogicalPage>, kvshard::Error> = match op {
            Op::New { pages } => alloc
                .alloc(AllocRequest { chain: ChainStart::New, pages: usize::from(pages) })
                .map(|a| a.pages),
            Op::Extend { start_owner, prefix_tokens, pages } => alloc
                .alloc(AllocRequest {
                    chain: ChainStart::Extend { start_owner, prefix_tokens: prefix_tokens as usize },
                    pages: usize::from(pages),
                })
                .map(|a| a.pages),
            Op::Batch(reqs) => {
                let reqs: Vec<AllocRequest> = reqs
                    .into_iter()
                    .take(8)
                    .map(|(new, owner, pages)| AllocRequest {
                        chain: if new {
                            ChainStart::New
                        } else {
                            ChainStart::Extend { start_owner: owner, prefix_tokens: 0 }
                        },
                        pages: usize::from(pages),
                    })
                    .collect();
                alloc
                    .alloc_batch(&reqs)
                    .map(|all| all.into_iter().flat_map(|a| a.pages).collect())
            }
            Op::Matching(pages) => {
                let pages: Vec<LogicalPage> = pages.into_iter().take(64).map(LogicalPage).collect();
                alloc.alloc_matching(&pages)
            }
            Op::FreeSome { every, offset } => {
                let every = usize::from(every.max(1));
                let pick: Vec<LogicalPage> = held
                    .iter()
                    .skip(usize::from(offset) % (held.len() + 1))
                    .step_by(every)
                    .copied()
                    .collect();
                let freed = alloc.free(&pick);
                if freed.is_ok() {
                    held.retain(|p| !pick.contains(p));
                }
                freed.map(|()| Vec::new())
            }
            Op::FreeRaw(pages) => {
                let pages: Vec<LogicalPage> = pages.into_iter().take(64).map(LogicalPage).collect();
                let freed = alloc.free(&pages);
                if freed.is_ok() {
                    held.retain(|p| !pages.contains(p));
                }
                freed.map(|()| Vec::new())
            }
        };
        match result {
            Ok(pages) => held.extend(pages),
            Err(_) => assert_eq!(alloc, before, "a failed call changed the allocator"),
        }
        let distinct: HashSet<_> = held.iter().collect();
        assert_eq!(distinct.len(), held.len(), "a page was handed out twice");
        assert_eq!(alloc.total_free() + held.len(), total, "free counts do not add up");
        assert!(held.iter().all(|&p| alloc.is_allocated(p)));
    }
});
