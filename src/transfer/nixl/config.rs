//! The settings of either side of a NIXL connection: [`NixlConfig`], and [`NixlMode`], how a
//! prefill rank posts each chunk.

use std::time::Duration;

/// How a [`NixlTransport`](super::NixlTransport) posts each chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NixlMode {
    /// Bounce or coalesced per chunk, by the rule in the module docs.
    Auto,
    /// Coalesced runs only.
    Coalesced,
    /// Bounce whenever a slot is free on both sides and the sections fit a slot; coalesced
    /// otherwise.
    Bounce,
    /// One descriptor per (page, layer) block, unmerged (the baseline).
    PerBlock,
}

/// Settings of either side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NixlConfig {
    /// The NIXL agent's name: unique among the agents that meet.
    pub agent: String,
    /// How chunks are posted (prefill side).
    pub mode: NixlMode,
    /// Pages one bounce slot holds (decode side; the prefill side takes the decode's figure).
    /// A slot holds that many pages of every component: `slot_pages x page bytes` each side.
    /// 0 disables bouncing.
    pub slot_pages: u64,
    /// Bounce slots per prefill rank (decode side; at most
    /// [`MAX_NIXL_SLOTS`](crate::ipc::wire::MAX_NIXL_SLOTS)).
    pub slots: usize,
    /// [`NixlMode::Auto`] bounces a chunk whose coalesced descriptors average fewer bytes.
    pub bounce_below: u64,
    /// A transfer that has not landed this long after it was posted fails (prefill side).
    pub transfer_timeout: Duration,
    /// How long the decode side waits for a request, from its registration to every rank's
    /// last status, before [`NixlTarget::expire`](super::NixlTarget::expire) reports it overdue (decode side).
    pub deadline: Duration,
}

impl NixlConfig {
    /// Defaults for agent `agent`: [`NixlMode::Auto`], 2 slots of 64 pages per rank, bounce
    /// under 512 KiB per descriptor, 30 s transfer timeout, requests due
    /// [`DEFAULT_DEADLINE`](crate::transfer::DEFAULT_DEADLINE) after registration.
    pub fn new(agent: impl Into<String>) -> Self {
        Self {
            agent: agent.into(),
            mode: NixlMode::Auto,
            slot_pages: 64,
            slots: 2,
            bounce_below: 512 << 10,
            transfer_timeout: Duration::from_secs(30),
            deadline: crate::transfer::DEFAULT_DEADLINE,
        }
    }
}
