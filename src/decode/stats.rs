//! What an engine run did besides decoding, counted by the engine and its stepper.

/// What an engine run did besides decoding.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct EngineStats {
    /// The mode that ran.
    pub mode: String,
    /// Decode steps (batched forwards).
    pub steps: u64,
    /// Rows decoded over all steps, finished rows awaiting compaction included.
    pub row_steps: u64,
    /// Tokens kept.
    pub tokens: u64,
    /// Seconds spent copying snapshots into batches.
    pub gather_seconds: f64,
    /// Seconds spent verifying fingerprints before decoding (device comparisons, host copies).
    pub verify_seconds: f64,
    /// Seconds inside decode steps, waiting for the device included.
    #[serde(default)]
    pub step_seconds: f64,
    /// Seconds spent after decoding waiting for the host copies' hashes.
    #[serde(default)]
    pub hash_wait_seconds: f64,
    /// Snapshot copies hashed (other rows were compared with them on the device); distinct
    /// per batch, while a queue hashes a snapshot again when no resident row shares it.
    pub hashed_snapshots: u64,
    /// CUDA graphs captured (one per batch size met).
    pub graph_captures: u64,
    /// Seconds spent capturing them (warm-up run included).
    pub capture_seconds: f64,
    /// Nodes (kernels, copies) of the last captured graph: the launches of one step.
    pub graph_nodes: Option<u64>,
    /// Why graphs were abandoned for the static step, if they were.
    pub graph_fallback: Option<String>,
}

impl EngineStats {
    /// One line for tables.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "[{}: {} steps in {:.3} s, {:.0}% rows live, gather {:.3} s, verify {:.3} s ({} hashed, {:.3} s waited for)",
            self.mode,
            self.steps,
            self.step_seconds,
            100.0 * self.tokens as f64 / self.row_steps.max(1) as f64,
            self.gather_seconds,
            self.verify_seconds,
            self.hashed_snapshots,
            self.hash_wait_seconds
        );
        if self.graph_captures > 0 {
            s += &format!(
                ", {} graph captures in {:.3} s",
                self.graph_captures, self.capture_seconds
            );
            if let Some(n) = self.graph_nodes {
                s += &format!(", {n} nodes/step");
            }
        }
        if let Some(why) = &self.graph_fallback {
            s += &format!(", graphs abandoned: {why}");
        }
        s + "]"
    }
}
