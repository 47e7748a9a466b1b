//! Time to first token of a real tiered transfer (`kvcredit spectrum send`, the spec's
//! `[ttft]` section): the prefill worker prefills a WikiText-2 context, scores, compresses and
//! sends it to a decode worker ([`super::transport`]), which restores it and decodes the first
//! token; beside it, an FP16 transfer of the same context over the same link. Each stage is
//! timed; the worker's first token and KV fingerprint must equal those of the same frame decoded
//! in-process, or the measurement is refused.
use super::allocate::{Policy, Protect};
use super::eval::{self, Variant};
use super::importance::ImportanceSpec;
use super::spec::TtftSpec;
use super::{Tier, transport, wire};
use crate::exec::ExecPolicy;
use crate::io::parquet::{Column, Table};
use crate::model::Decoder;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// One transfer's stages (milliseconds) and what it sent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TtftRow {
    /// `tiered` or `fp16`.
    pub transfer: String,
    /// Repeat index on this link (repeat 0 also warms the workers up).
    pub repeat: u32,
    /// Link limit, megabits per second; `None`: unlimited.
    pub bandwidth_mbps: Option<f64>,
    /// Frame bytes ÷ full-FP16 bytes.
    pub b_real: f64,
    /// Frame bytes.
    pub bytes: u64,
    /// The decode worker's first token.
    pub first_token: i64,
    /// Prefill forward.
    pub prefill_ms: f64,
    /// Importance scoring (0 for the FP16 transfer, which needs none).
    pub scoring_ms: f64,
    /// Allocation, quantization and packing.
    pub pack_ms: f64,
    /// Writing the request.
    pub send_ms: f64,
    /// Worker: first byte to last byte received.
    pub receive_ms: f64,
    /// Worker: parse, verify, dequantize.
    pub unpack_ms: f64,
    /// Worker: the first decode step.
    pub first_step_ms: f64,
    /// Sender: first byte written to the reply read.
    pub round_trip_ms: f64,
    /// prefill + scoring + pack + round trip.
    pub ttft_ms: f64,
}

/// What one repeat of a TTFT run measures with.
pub struct TtftRun<'a> {
    /// The decoder of the prefill side.
    pub model: &'a Decoder,
    /// The `[ttft]` section.
    pub spec: &'a TtftSpec,
    /// Importance settings of the tiered transfer.
    pub importance: &'a ImportanceSpec,
    /// Tokens the tiered transfer pins to FP16.
    pub protect: Protect,
    /// Execution policy.
    pub policy: &'a ExecPolicy,
    /// The context: `spec.context` WikiText-2 tokens.
    pub ids: &'a [i64],
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

impl TtftRun<'_> {
    /// The tiered and the FP16 variant of the section.
    fn variants(&self) -> Result<[(&'static str, Variant, Protect); 2]> {
        let policy = Policy::parse(&self.spec.policy)?;
        let tiered = Variant {
            policy,
            quantizer: self.spec.quantizer,
            b: policy.uses_budget().then_some(self.spec.b),
        };
        let fp16 = Variant {
            policy: Policy::Uniform(Tier::Fp16),
            quantizer: self.spec.quantizer,
            b: None,
        };
        // The FP16 transfer sends every token at 16 bits: nothing to protect or score.
        let none = Protect {
            sinks: 0,
            recent: 0,
        };
        Ok([("tiered", tiered, self.protect), ("fp16", fp16, none)])
    }

    /// Both transfers of repeat `repeat` over `stream`, paced to `mbps` when given.
    pub fn repeat(
        &self,
        stream: &mut TcpStream,
        mbps: Option<f64>,
        repeat: u32,
    ) -> Result<Vec<TtftRow>> {
        let (ctx, last) = self.ids.split_at(self.ids.len() - 1);
        let mut rows = Vec::new();
        for (what, v, protect) in self.variants()? {
            let t0 = Instant::now();
            let pre = eval::prefill_and_score(self.model, ctx, self.policy, self.importance)?;
            let c = eval::compress(&pre, &v, protect)?;
            let sent_at = Instant::now();
            let reply = transport::request(stream, &c.frame, last[0], 1, mbps)?;
            // The FP16 transfer needs no scores: its TTFT leaves the scoring out.
            let scoring = if what == "fp16" {
                Duration::ZERO
            } else {
                pre.scoring
            };
            let total = (sent_at - t0) - (pre.scoring - scoring) + reply.round_trip;
            let local = wire::decode(&c.frame)?;
            let (tokens, _, _, fp) =
                transport::decode_greedy(self.model, &local, last[0], 1, self.policy)?;
            if tokens != reply.tokens || fp != reply.fingerprint {
                return Err(Error::Spectrum(format!(
                    "{what} transfer: the decode worker answered {:?}, in-process {:?} (KV fingerprints {}); is the worker serving the same model, dtype and policy?",
                    reply.tokens,
                    tokens,
                    if fp == reply.fingerprint {
                        "equal"
                    } else {
                        "differ"
                    }
                )));
            }
            rows.push(TtftRow {
                transfer: what.to_string(),
                repeat,
                bandwidth_mbps: mbps,
                b_real: c.real_b(),
                bytes: c.frame.len() as u64,
                first_token: reply.tokens[0],
                prefill_ms: ms(pre.prefill),
                scoring_ms: ms(scoring),
                pack_ms: ms(c.pack),
                send_ms: ms(reply.send),
                receive_ms: ms(reply.receive),
                unpack_ms: ms(reply.unpack),
                first_step_ms: ms(reply.first_step),
                round_trip_ms: ms(reply.round_trip),
                ttft_ms: ms(total),
            });
        }
        Ok(rows)
    }
}

/// The `ttft.parquet` table of `rows` (schema in `docs/guide/spectrum.md`).
pub fn ttft_table(rows: &[TtftRow], model: &str, t: &TtftSpec) -> Table {
    let n = rows.len();
    let f = |g: fn(&TtftRow) -> f64| Column::F64(rows.iter().map(g).collect());
    Table::new()
        .with("model", Column::Str(vec![model.to_string(); n]))
        .with(
            "transfer",
            Column::Str(rows.iter().map(|r| r.transfer.clone()).collect()),
        )
        .with("tier_policy", Column::Str(vec![t.policy.clone(); n]))
        .with(
            "quantizer",
            Column::Str(vec![t.quantizer.name().to_string(); n]),
        )
        .with("b", Column::F64(vec![t.b; n]))
        .with("b_real", f(|r| r.b_real))
        .with(
            "bytes",
            Column::I64(rows.iter().map(|r| r.bytes as i64).collect()),
        )
        .with("context", Column::U32(vec![t.context as u32; n]))
        .with("text", Column::Str(vec![t.text.to_string(); n]))
        .with(
            "bandwidth_mbps",
            Column::OptF64(rows.iter().map(|r| r.bandwidth_mbps).collect()),
        )
        .with(
            "repeat",
            Column::U32(rows.iter().map(|r| r.repeat).collect()),
        )
        .with(
            "first_token",
            Column::I64(rows.iter().map(|r| r.first_token).collect()),
        )
        .with("prefill_ms", f(|r| r.prefill_ms))
        .with("scoring_ms", f(|r| r.scoring_ms))
        .with("pack_ms", f(|r| r.pack_ms))
        .with("send_ms", f(|r| r.send_ms))
        .with("receive_ms", f(|r| r.receive_ms))
        .with("unpack_ms", f(|r| r.unpack_ms))
        .with("first_step_ms", f(|r| r.first_step_ms))
        .with("round_trip_ms", f(|r| r.round_trip_ms))
        .with("ttft_ms", f(|r| r.ttft_ms))
}
