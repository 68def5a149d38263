//! P/D send plans from arbitrary registrations, chunks and page tables: no panic; a plan that
//! builds moves only its rank's pages, inside both pools, as many bytes as its descriptors say.
#![no_main]

use arbitrary::Arbitrary;
use kvshard::geometry::{CacheGeometry, LatentLayout, PoolGeometry};
use kvshard::index::{LocalPage, LogicalPage};
use kvshard::shard::Placement;
use kvshard::transfer::{ChunkRange, PoolLayout, PrefillRank, Registration, SendPlan};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
struct Input {
    shard: u8,
    rank: u32,
    draft: bool,
    layers: u8,
    src_pool_pages: u64,
    dst_pool_pages: u64,
    prefix_pages: usize,
    pages: Vec<u64>,
    state_pages: Vec<u64>,
    src: Vec<u64>,
    index: u32,
    start: usize,
    end: usize,
    last: bool,
    stride_tweak: Option<(u8, u64)>,
}

fuzz_target!(|input: Input| {
    let Ok(placement) = Placement::new(u32::from(input.shard % 9)) else {
        return;
    };
    let target = PoolGeometry::new(LatentLayout::Fp8Trtllm, usize::from(input.layers % 5));
    let geometry = if input.draft {
        CacheGeometry::with_draft(target)
    } else {
        CacheGeometry::target_only(target)
    };
    let source = PrefillRank {
        placement,
        rank: input.rank,
        layout: PoolLayout::packed(geometry.clone(), input.src_pool_pages),
    };
    let mut layout = PoolLayout::packed(geometry, input.dst_pool_pages);
    if let Some((i, s)) = input.stride_tweak {
        if let Some(stride) = layout.page_strides.get_mut(usize::from(i)) {
            *stride = s;
        }
    }
    let registration = Registration {
        request: 1,
        layout,
        prefix_pages: input.prefix_pages,
        pages: input.pages.iter().take(128).map(|&p| LocalPage(p)).collect(),
        state_pages: input.state_pages.iter().take(128).map(|&p| LocalPage(p)).collect(),
    };
    let src: Vec<LogicalPage> = input.src.iter().take(128).map(|&p| LogicalPage(p)).collect();
    let chunk = ChunkRange {
        index: input.index,
        start: input.start,
        end: input.end,
        last: input.last,
    };
    let Ok(plan) = SendPlan::new(&source, &src, &registration, chunk) else {
        return;
    };
    let total: u64 = plan.descriptors().map(|d| d.bytes).sum();
    assert_eq!(total, plan.bytes().total());
    for section in plan.sections() {
        for run in section.runs() {
            assert!(run.src.0 + run.pages <= input.src_pool_pages);
            assert!(run.dst.0 + run.pages <= input.dst_pool_pages);
        }
    }
    let _ = plan.to_string();
});
