//! The pressure run's configuration, identical in every process of it, and what it needs.

use kvshard::copy::Method;
use kvshard::shard::DecodeLayout;
use kvshard::{Error, Result};

use super::super::{blocks, check_method, method_name, shape_args, Processes};
use crate::scenario::{Platform, PressureConfig};

/// One run of the scenario across processes, identical in every process of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PressurePdConfig {
    /// The scenario every process drives (its ranks are the prefill processes).
    pub scenario: PressureConfig,
    /// Where the processes run: every decode process receives every prompt (its whole cache,
    /// or its share of a decode context-parallel group's).
    pub processes: Processes,
    /// How each decode shards its cache: unsharded (one process per decode), or a decode
    /// context-parallel group of `ranks()` processes, token `t` on rank `(t / I) % M`
    /// (docs/dcp.md). `processes.decodes` counts processes: decodes x M, decode `g`'s rank `d`
    /// being decode process `g M + d`.
    pub decode_layout: DecodeLayout,
    /// How ranks send chunks to the decodes.
    pub method: Method,
    /// Whether the ranks all-gather over NCCL (GPUs, one rank per GPU) instead of through host
    /// shared memory.
    pub nccl: bool,
}

impl PressurePdConfig {
    /// The default for the CPU twin (the scenario's CPU shape, seconds) or GPUs (61 layers and
    /// the draft, one-launch sends with 132 CTAs): CP2 and two decodes, the seed's topology.
    pub fn default_for(platform: Platform) -> Self {
        Self {
            scenario: PressureConfig::default_for(platform),
            processes: Processes::new(platform, 2),
            decode_layout: DecodeLayout::unsharded(),
            method: blocks(if platform.is_gpu() { 132 } else { 2 }),
            nccl: false,
        }
    }

    /// Checks the run makes sense before any process starts.
    pub fn validate(&self) -> Result<()> {
        self.scenario.pages_per_rank()?;
        self.processes.check(self.scenario.shape.ranks)?;
        if !self.processes.platform.is_gpu() && self.nccl {
            return Err(Error::InvalidArgument(
                "pd pressure: NCCL needs GPUs".into(),
            ));
        }
        check_method(&self.method)?;
        let m = self.decode_layout.ranks();
        if self.is_dcp() && !matches!(self.method, Method::Kernel(_)) {
            return Err(Error::InvalidArgument(format!(
                "pd pressure: decode context-parallel groups take the block kernel's method \
                 (`blocks`), not {}",
                method_name(&self.method)
            )));
        }
        if self.processes.decodes % m != 0 {
            return Err(Error::InvalidArgument(format!(
                "pd pressure: {} decode processes are no whole number of DCP{m} groups",
                self.processes.decodes
            )));
        }
        Ok(())
    }

    /// Whether the decodes are decode context-parallel groups (more than one rank each).
    pub fn is_dcp(&self) -> bool {
        self.decode_layout.ranks() > 1
    }

    /// Decodes: unsharded decode processes, or decode context-parallel groups.
    pub fn decode_groups(&self) -> u32 {
        self.processes.decodes / self.decode_layout.ranks()
    }

    /// Pages of each decode process's pool: its rows of both prompts (every row of an unsharded
    /// decode; rank 0 of a group holds the most), registered up front with a poisoned page
    /// before, between and after them (a write past a request's pages shows), and page 0.
    pub fn decode_pages(&self) -> u64 {
        let tokens = self.scenario.prompt_tokens as u64;
        2 * self.decode_layout.pages_on(0, tokens) + 4
    }

    /// Bytes the run needs, device then host, over every process: each rank's pool, reference,
    /// staging, send buffers and scratch, each decode's pool and reference; each rank's host
    /// pool and the group memory. An estimate (tables and small buffers left out).
    pub fn memory(&self) -> Result<(u64, u64)> {
        let sc = &self.scenario;
        let over = |what: &str| Error::Overflow {
            what: format!("the pressure run's {what}"),
        };
        let mul = |a: u64, b: u64, what: &str| a.checked_mul(b).ok_or_else(|| over(what));
        let add = |a: u64, b: u64, what: &str| a.checked_add(b).ok_or_else(|| over(what));
        let page = sc.shape.geometry().page_bytes_checked()? as u64;
        let per_rank = sc.pages_per_rank()?;
        let reference = sc.reference_pages();
        let chunk = sc.chunk.div_ceil(kvshard::geometry::PAGE_SIZE) as u64;
        let (_, layout) = sc.scratch()?;
        let scratch = layout.map_or(0, |l| l.pages() + 2 * l.prefix_pages());
        let ranks = u64::from(sc.shape.ranks);
        let sends = mul(sc.send_pages()?, ranks, "send pages")?;
        let rank_pages = [reference, chunk, scratch, sends]
            .into_iter()
            .try_fold(per_rank, |a, b| add(a, b, "pages per rank"))?;
        let decode_pages = add(self.decode_pages(), reference + chunk, "pages per decode")?;
        let pages = add(
            mul(ranks, rank_pages, "pages")?,
            mul(u64::from(self.processes.decodes), decode_pages, "pages")?,
            "pages",
        )?;
        let host_pages = mul(
            ranks,
            mul(per_rank, sc.host_factor, "host pages")?,
            "host pages",
        )?;
        let group = kvshard::ipc::group::group_bytes(sc.shape.ranks, self.slot_bytes()?)? as u64;
        Ok((
            mul(pages, page, "device bytes")?,
            add(mul(host_pages, page, "host bytes")?, group, "host bytes")?,
        ))
    }

    /// Bytes of each slot of the group memory (none when NCCL gathers).
    pub fn slot_bytes(&self) -> Result<usize> {
        if self.nccl {
            Ok(0)
        } else {
            self.scenario.send_bytes()
        }
    }

    /// The command-line flags that give this configuration (after `pd --scenario pressure`).
    pub fn to_args(&self) -> Vec<String> {
        let mut args = shape_args(&self.scenario.shape);
        args.extend(self.processes.to_args());
        args.extend([
            "--decodes".into(),
            self.decode_groups().to_string(),
            "--decode-dcp".into(),
            self.decode_layout.ranks().to_string(),
            "--decode-interleave".into(),
            self.decode_layout.interleave().to_string(),
            "--methods".into(),
            method_name(&self.method),
            "--all-gather".into(),
            if self.nccl { "nccl" } else { "host" }.into(),
        ]);
        args
    }
}

/// Whether the ranks of `cfg` can all-gather over NCCL on a machine of `present` GPUs: built
/// with the `nccl` feature, on GPUs, each rank on a GPU of its own, libnccl loadable.
pub fn nccl_possible(cfg: &PressurePdConfig, present: usize) -> bool {
    let p = &cfg.processes;
    cfg!(feature = "nccl")
        && p.platform.is_gpu()
        && p.ranks_on_distinct_gpus(cfg.scenario.shape.ranks, present)
        && nccl_present()
}

#[cfg(feature = "nccl")]
fn nccl_present() -> bool {
    kvshard::nccl::nccl_present()
}

#[cfg(not(feature = "nccl"))]
fn nccl_present() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::pd::Role;

    use super::*;

    #[test]
    fn processes_sit_on_the_seed_topology_or_share_the_gpus_there_are() {
        let cfg = PressurePdConfig::default_for(Platform::Gpu);
        let p = &cfg.processes;
        let on = |present| {
            let ranks: Vec<usize> = (0..2)
                .map(|r| p.gpu_of(2, Role::Rank(r), present))
                .collect();
            let decodes: Vec<usize> = (0..2)
                .map(|d| p.gpu_of(2, Role::Decode(d), present))
                .collect();
            (ranks, decodes)
        };
        assert_eq!(on(4), (vec![0, 1], vec![2, 3]));
        assert_eq!(on(3), (vec![0, 1], vec![2, 2]));
        assert_eq!(on(2), (vec![0, 1], vec![1, 1]));
        assert_eq!(on(1), (vec![0, 0], vec![0, 0]));
        assert!(p.ranks_on_distinct_gpus(2, 2));
        assert!(!p.ranks_on_distinct_gpus(2, 1));
        let named = Processes {
            gpus: vec![3, 2, 1, 0],
            ..p.clone()
        };
        assert_eq!(named.gpu_of(2, Role::Rank(0), 4), 3);
        assert_eq!(named.gpu_of(2, Role::Decode(1), 4), 0);
    }

    #[test]
    fn a_run_that_cannot_work_is_refused_before_any_process_starts() {
        let cpu = PressurePdConfig::default_for(Platform::Cpu);
        assert!(cpu.validate().is_ok());
        let mut bad = vec![
            PressurePdConfig {
                nccl: true,
                ..cpu.clone()
            },
            PressurePdConfig {
                method: blocks(0),
                ..cpu.clone()
            },
        ];
        for decodes in [0, crate::pd::MAX_DECODES + 1] {
            let mut c = cpu.clone();
            c.processes.decodes = decodes;
            bad.push(c);
        }
        // GPUs named for a run on the CPU twin, or for a GPU run, not one per process.
        let mut c = cpu.clone();
        c.processes.gpus = vec![0, 0, 0, 0];
        bad.push(c);
        let mut c = PressurePdConfig::default_for(Platform::Gpu);
        c.processes.gpus = vec![0, 1];
        bad.push(c);
        let mut c = cpu.clone();
        c.processes.deadline = Duration::ZERO;
        bad.push(c);
        let mut c = cpu.clone();
        c.scenario.shape.ranks = 3;
        bad.push(c);
        // Decode context-parallel groups: sent with the block kernel only, whole groups only.
        let mut c = cpu.clone();
        c.decode_layout = kvshard::shard::DecodeLayout::new(2, 1).unwrap();
        c.method = Method::CopyEngine;
        bad.push(c);
        let mut c = cpu.clone();
        c.decode_layout = kvshard::shard::DecodeLayout::new(2, 1).unwrap();
        c.processes.decodes = 3;
        bad.push(c);
        for cfg in bad {
            assert!(
                matches!(cfg.validate(), Err(Error::InvalidArgument(_))),
                "{cfg:?}"
            );
        }
    }
}
