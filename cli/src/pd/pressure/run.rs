//! The pressure run: starts the ranks and the decodes and builds the report from their
//! messages.

use std::path::Path;

use kvshard::ipc::group::GroupMemory;
use kvshard::Result;

use super::super::{run_roles, socket_path, Report, Role};
use super::report::table;
use super::{decode_socket, PressurePdConfig};

/// Runs `cfg`: creates the CP group memory, starts the ranks and the decodes
/// (`exe pd --scenario pressure --role ...`), forwards what they print, and builds the report
/// from their messages.
pub fn run(cfg: &PressurePdConfig, exe: &Path) -> Result<Report> {
    cfg.validate()?;
    let ranks = cfg.scenario.shape.ranks;
    let decodes = cfg.processes.decodes;
    let group = GroupMemory::create(ranks, cfg.slot_bytes()?)?;
    let socket = socket_path("pdp");
    let mut args = vec!["pd".to_string(), "--scenario".into(), "pressure".into()];
    args.extend(cfg.to_args());
    args.extend([
        "--socket".into(),
        socket.display().to_string(),
        "--group".into(),
        group.proc_path().display().to_string(),
    ]);
    let roles = (0..decodes)
        .map(Role::Decode)
        .chain((0..ranks).map(Role::Rank))
        .collect();
    // The storage step's directory, shared by the ranks: private to this run (a random name,
    // mode 0700), named to them, removed once they have exited.
    #[cfg(feature = "nixl")]
    let storage = crate::demo::pressure::storage::group_directory()?;
    #[cfg(feature = "nixl")]
    args.extend(["--storage-dir".into(), storage.path().display().to_string()]);
    let messages = run_roles(exe, &args, roles);
    #[cfg(feature = "nixl")]
    drop(storage);
    for d in 0..decodes {
        let _ = std::fs::remove_file(decode_socket(&socket, d));
    }
    drop(group);
    let shared_gpu = cfg.processes.ranks_share_a_gpu(ranks);
    Ok(Report {
        markdown: table(cfg, &messages?, shared_gpu),
    })
}
