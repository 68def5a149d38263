//! HiCache transfer plans from arbitrary page lists: no panic; a plan that builds keeps only its
//! rank's pairs, in range, with distinct pages on each side.
#![no_main]

use arbitrary::Arbitrary;
use kvshard::hicache::TransferPlan;
use kvshard::index::LogicalPage;
use kvshard::shard::Placement;
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
struct Input {
    shard: u32,
    rank: u32,
    device: Vec<u64>,
    host: Vec<u64>,
    device_pages: u64,
    host_pages: u64,
}

fuzz_target!(|input: Input| {
    let Ok(placement) = Placement::new(input.shard) else {
        return;
    };
    let device: Vec<LogicalPage> = input.device.iter().take(256).map(|&p| LogicalPage(p)).collect();
    let host: Vec<LogicalPage> = input.host.iter().take(256).map(|&p| LogicalPage(p)).collect();
    let Ok(plan) = TransferPlan::new(
        placement,
        input.rank,
        &device,
        &host,
        input.device_pages,
        input.host_pages,
    ) else {
        return;
    };
    assert!(plan.len() <= plan.requested());
    assert!(plan.device_pages().iter().all(|p| p.0 < input.device_pages));
    assert!(plan.host_pages().iter().all(|p| p.0 < input.host_pages));
    let runs: u64 = plan.runs().iter().map(|r| r.pages).sum();
    assert_eq!(runs, plan.len() as u64);
    for &i in plan.positions() {
        assert_eq!(placement.owner(device[i]), input.rank);
    }
});
