//! examples/engine.rs, the flow an engine copies, held to what it promises: every token of both
//! requests on the decode side equal to the reference, the cached prefix reloaded, and zero
//! host-blocking waits in every prefill chunk. On the CPU twin (adversarial and immediate
//! stream orders) and, on a GPU, as DeepSeek-V3.2: 61 layers and the MTP draft.

mod common;

use std::sync::Arc;

use kvshard::backend::cpu::{CpuBackend, StreamOrder};
use kvshard::backend::cuda::CudaBackend;
use kvshard::backend::Backend;

// The example's code itself, so that what it shows is what is tested; its `main` is the
// example binary's, unused here.
#[allow(dead_code)]
#[path = "../examples/engine.rs"]
mod example;

fn holds(report: &example::Report, shape: &example::Shape, on: &str) {
    assert_eq!(
        report.tokens_checked,
        shape.prompt + shape.second,
        "{on}: every token of both requests checked"
    );
    assert_eq!(report.pages_reloaded, shape.prompt / 64, "{on}");
    let chunks = shape.prompt.div_ceil(shape.chunk)
        + (shape.second - report.pages_reloaded * 64).div_ceil(shape.chunk);
    assert_eq!(report.waits_per_chunk.len(), chunks, "{on}");
    assert!(
        report.waits_per_chunk.iter().all(|&w| w == 0),
        "{on}: a prefill chunk waited on the host: {:?}",
        report.waits_per_chunk
    );
    assert_eq!(
        report.waits_outside_sync, 0,
        "{on}: a call not named _sync waited on the host"
    );
}

#[test]
fn cpu_the_engine_example_runs_with_no_host_wait_per_chunk() {
    for order in [StreamOrder::Adversarial(17), StreamOrder::Immediate] {
        let cpu = CpuBackend::with_order(order);
        let new_stream = || -> kvshard::Result<Arc<dyn Backend>> { Ok(Arc::new(cpu.new_stream())) };
        let shape = example::Shape::small();
        let report = example::run(&new_stream, &shape).expect("the example's flow");
        holds(&report, &shape, &format!("the CPU twin ({order:?})"));
    }
}

#[test]
fn gpu_the_engine_example_runs_with_no_host_wait_per_chunk() {
    let Some(gpu) = common::open_gpu("gpu_the_engine_example_runs_with_no_host_wait_per_chunk")
    else {
        return;
    };
    let new_stream =
        || -> kvshard::Result<Arc<dyn Backend>> { Ok(Arc::new(CudaBackend::new(gpu.clone())?)) };
    let shape = example::Shape::deepseek();
    let report = example::run(&new_stream, &shape).expect("the example's flow");
    holds(&report, &shape, &gpu.info().name);
}
