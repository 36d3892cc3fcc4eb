//! Typed errors of the communication layer.
//!
//! Every failure of a collective names the operation, its sequence number in the
//! group, the group and — where the backend can know it — the ranks that did not
//! arrive, so that a hung or crashed worker is found from any rank's log.

use crate::group::Operation;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// Identifies one collective call: what it was, which call of the group it was, and
/// on which group it ran. Embedded in every error so messages are self-explanatory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpContext {
    /// Operation name, e.g. `all_reduce`.
    pub op: &'static str,
    /// Sequence number (1 = first call; 0 = not numbered, e.g. setting a group up): of the
    /// collective within its group, or of a send or receive among this rank's messages to
    /// (from) `peer`, so that the n-th send to a rank is that rank's n-th receive from this
    /// one and a lost message is named alike on both sides.
    pub seq: u64,
    /// The other rank of a send or receive, as its rank in the group; `None` otherwise.
    /// (32 bits: a group has far fewer ranks, and every error carries a context, which
    /// keeps `CommError` small enough to return by value.)
    pub peer: Option<u32>,
    /// Group name, e.g. `world` or `dp[0,2]` (shared, so building a context per
    /// operation costs no allocation).
    pub group: Arc<str>,
}

impl OpContext {
    /// The context of a call that names no peer (a collective, or setting a group up).
    pub fn new(op: &'static str, seq: u64, group: Arc<str>) -> OpContext {
        OpContext {
            op,
            seq,
            peer: None,
            group,
        }
    }

    /// The context of operation `op`, number `seq`, naming the peer of a send or receive.
    pub fn of(op: &Operation, seq: u64, group: Arc<str>) -> OpContext {
        OpContext::new(op.name(), seq, group).naming_the_peer_of(op)
    }

    /// This context, naming the other rank when `op` is a send or receive.
    pub fn naming_the_peer_of(mut self, op: &Operation) -> OpContext {
        self.peer = op.peer().and_then(|p| u32::try_from(p).ok());
        self
    }
}

impl fmt::Display for OpContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.op)?;
        if self.seq != 0 {
            write!(f, " #{}", self.seq)?;
        }
        if let Some(peer) = self.peer {
            let direction = if self.op.starts_with("send") {
                "to"
            } else {
                "from"
            };
            write!(f, " {direction} rank {peer}")?;
        }
        write!(f, " on group '{}'", self.group)
    }
}

/// Formats a list of ranks as `[0, 2]` for messages.
pub(crate) fn fmt_ranks(ranks: &[usize]) -> String {
    let inner: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
    format!("[{}]", inner.join(", "))
}

fn missing_text(missing: &[usize], note: &str) -> String {
    let mut text = if missing.is_empty() {
        "some rank(s) did not arrive (the backend could not tell which)".to_string()
    } else {
        format!("rank(s) {} (global) did not arrive", fmt_ranks(missing))
    };
    if !note.is_empty() {
        text.push_str(&format!(" ({note})"));
    }
    text
}

/// Errors of process groups and their backends.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// Some ranks did not reach the operation before the timeout.
    #[error("{ctx} timed out after {timeout:?}: {}", missing_text(.missing, .note))]
    Timeout {
        ctx: OpContext,
        timeout: Duration,
        /// Global ranks that had not arrived; empty if the backend could not tell.
        missing: Vec<usize>,
        /// Where the missing ranks were last seen (MPI's failure monitor knows), or empty.
        /// (A boxed str: every failure carries its context, and this keeps the error small
        /// enough to return by value through the layers above.)
        note: Box<str>,
    },
    /// A rank the operation waits for has panicked, failed or exited.
    #[error("{ctx} cannot complete: rank(s) {} (global) stopped: {reason}", fmt_ranks(.missing))]
    PeerFailed {
        ctx: OpContext,
        missing: Vec<usize>,
        reason: String,
    },
    /// Ranks called different collectives (or the same one with different shapes) at
    /// the same sequence number. Detected before any data is touched.
    #[error("{ctx}: collective mismatch across ranks: {details}")]
    Desync { ctx: OpContext, details: String },
    /// A buffer's length or dtype does not fit the operation.
    #[error("{ctx}: invalid buffer: {details}")]
    InvalidBuffer { ctx: OpContext, details: String },
    /// A rank argument (root, peer, sub-group member) is out of range or repeated.
    #[error("{ctx}: invalid rank: {details}")]
    InvalidRank { ctx: OpContext, details: String },
    /// The group failed earlier (timeout, desync, peer failure) and cannot be used.
    #[error("{ctx}: group is unusable after an earlier failure: {cause}")]
    Broken { ctx: OpContext, cause: String },
    /// The backend itself reported an error (e.g. an MPI error code).
    #[error("{ctx}: backend error: {details}")]
    Backend { ctx: OpContext, details: String },
}

impl CommError {
    /// The context (op, sequence number, group) of the failed call.
    pub fn context(&self) -> &OpContext {
        match self {
            CommError::Timeout { ctx, .. }
            | CommError::PeerFailed { ctx, .. }
            | CommError::Desync { ctx, .. }
            | CommError::InvalidBuffer { ctx, .. }
            | CommError::InvalidRank { ctx, .. }
            | CommError::Broken { ctx, .. }
            | CommError::Backend { ctx, .. } => ctx,
        }
    }
}
