//! TCP transport between a prefill worker and a decode worker.
//!
//! A request is an envelope — magic `SPRQ`, version u16, reserved u16, the first token to
//! feed (u32), greedy steps (u32), the frame's length (u64) — followed by a [`super::wire`]
//! frame. The reply is `SPRS`, a status byte, then either (ok) the generated tokens (u32
//! count, u32 each), the worker's timings in nanoseconds (receive, unpack/dequantize, first
//! decode step; u64 each) and the SHA-256 of the restored KV (32 bytes), or (error) a u32
//! length and a one-line message. Frames above the worker's limit are refused before they are
//! read; any bad request gets an error reply and a log line, and the worker keeps serving.
use super::tiers::TieredKv;
use super::wire;
use crate::exec::ExecPolicy;
use crate::model::{Decoder, LogitsAt};
use crate::{Error, Result};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};
use tch::Tensor;

const REQUEST: &[u8; 4] = b"SPRQ";
const REPLY: &[u8; 4] = b"SPRS";
const VERSION: u16 = 1;
const ENVELOPE: usize = 24;
/// Most greedy steps one request may ask for.
pub const MAX_STEPS: u32 = 4096;

pub use crate::runtime::sync;

/// Greedy tokens decoded from a tiered context: the shared path of the decode worker and of
/// the in-process check. Returns the tokens, the unpack/dequantize and first-step durations,
/// and the restored cache's fingerprint.
pub fn decode_greedy(
    model: &Decoder,
    tiered: &TieredKv,
    first_token: i64,
    steps: usize,
    policy: &ExecPolicy,
) -> Result<(Vec<i64>, Duration, Duration, [u8; 32])> {
    let limit = model
        .context_limit()
        .unwrap_or(model.config().max_position_embeddings);
    tiered.check_fits(model.kv_shape(), limit, steps as i64)?;
    let t0 = Instant::now();
    let mut cache = tiered.restore(model.kind(), model.device(), steps as i64)?;
    sync(model.device());
    let unpack = t0.elapsed();
    let fingerprint = cache.fingerprint(cache.snapshot(0))?;
    let mut tokens = Vec::with_capacity(steps);
    let mut next = first_token;
    let mut first = Duration::ZERO;
    for i in 0..steps {
        let t1 = Instant::now();
        let ids = Tensor::f_from_slice(&[next])?.f_view([1, 1])?;
        let logits = model.forward(&ids, &mut cache, policy, &LogitsAt::Last)?;
        next = logits
            .f_view([-1])?
            .f_argmax(0, false)?
            .f_int64_value(&[])?;
        if i == 0 {
            first = t1.elapsed();
        }
        tokens.push(next);
    }
    Ok((tokens, unpack, first, fingerprint))
}

/// Settings of the decode worker.
#[derive(Debug, Clone, Copy)]
pub struct ServeOptions {
    /// Largest frame accepted, in bytes.
    pub max_frame: u64,
    /// Stop after this many requests (ok or not); `None`: serve forever.
    pub max_requests: Option<usize>,
    /// A connection that sends nothing for this long is dropped (a stalled or half-sent
    /// request cannot hold the worker).
    pub read_timeout: Duration,
    /// Execution policy of the decoder.
    pub policy: ExecPolicy,
}

/// Serve requests on `listener` until `max_requests`; `log` gets one line per request.
pub fn serve(
    model: &Decoder,
    listener: &TcpListener,
    opts: &ServeOptions,
    log: &mut dyn FnMut(&str),
) -> Result<()> {
    let mut served = 0usize;
    for stream in listener.incoming() {
        let mut stream = match stream {
            Ok(s) => s,
            Err(e) => {
                log(&format!("accept failed: {e}"));
                continue;
            }
        };
        if let Err(e) = stream.set_read_timeout(Some(opts.read_timeout)) {
            log(&format!("rejected: read timeout: {e}"));
            continue;
        }
        // Requests on one connection until it closes or a request fails.
        loop {
            if opts.max_requests.is_some_and(|m| served >= m) {
                return Ok(());
            }
            match handle(model, &mut stream, opts) {
                Ok(None) => break,
                Ok(Some(line)) => {
                    served += 1;
                    log(&line);
                }
                Err(e) => {
                    served += 1;
                    let msg = e.to_string();
                    log(&format!("rejected: {msg}"));
                    let _ = reply_error(&mut stream, &msg);
                    break;
                }
            }
        }
        if opts.max_requests.is_some_and(|m| served >= m) {
            return Ok(());
        }
    }
    Ok(())
}

fn net(what: &str, e: std::io::Error) -> Error {
    Error::Spectrum(format!("{what}: {e}"))
}

/// One request: `Ok(None)` when the peer closed before sending one.
fn handle(model: &Decoder, s: &mut TcpStream, opts: &ServeOptions) -> Result<Option<String>> {
    let mut env = [0u8; ENVELOPE];
    // The first byte tells an idle close from a request.
    match s.read(&mut env[..1]) {
        Ok(0) => return Ok(None),
        Ok(_) => {}
        Err(e) => return Err(net("read", e)),
    }
    let t0 = Instant::now();
    s.read_exact(&mut env[1..])
        .map_err(|e| net("truncated request envelope", e))?;
    if &env[..4] != REQUEST || u16::from_le_bytes([env[4], env[5]]) != VERSION {
        return Err(Error::Spectrum("not a version-1 SpectrumKV request".into()));
    }
    let first = u32::from_le_bytes(env[8..12].try_into().expect("4"));
    let steps = u32::from_le_bytes(env[12..16].try_into().expect("4"));
    let len = u64::from_le_bytes(env[16..24].try_into().expect("8"));
    if len > opts.max_frame {
        return Err(Error::Spectrum(format!(
            "frame of {len} bytes exceeds the limit of {}",
            opts.max_frame
        )));
    }
    if steps == 0 || steps > MAX_STEPS || first as usize >= model.config().vocab_size {
        return Err(Error::Spectrum(format!(
            "bad request: token {first}, {steps} steps"
        )));
    }
    let mut frame = vec![0u8; len as usize];
    s.read_exact(&mut frame)
        .map_err(|e| net(&format!("truncated frame (expected {len} bytes)"), e))?;
    let receive = t0.elapsed();
    let t1 = Instant::now();
    let tiered = wire::decode(&frame)?;
    let parse = t1.elapsed();
    let (tokens, unpack, step, fingerprint) =
        decode_greedy(model, &tiered, first as i64, steps as usize, &opts.policy)?;
    let unpack = unpack + parse;
    let mut out = Vec::with_capacity(64 + 4 * tokens.len());
    out.extend_from_slice(REPLY);
    out.push(0);
    out.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
    for &t in &tokens {
        out.extend_from_slice(&(t as u32).to_le_bytes());
    }
    for d in [receive, unpack, step] {
        out.extend_from_slice(&(d.as_nanos() as u64).to_le_bytes());
    }
    out.extend_from_slice(&fingerprint);
    s.write_all(&out).map_err(|e| net("reply", e))?;
    Ok(Some(format!(
        "served {len} bytes ({} tokens, {} dropped): first token {} [receive {:.1} ms, unpack {:.1} ms, step {:.1} ms]",
        tiered.len,
        tiered.dropped().len(),
        tokens[0],
        ms(receive),
        ms(unpack),
        ms(step)
    )))
}

fn reply_error(s: &mut TcpStream, msg: &str) -> std::io::Result<()> {
    let line = msg.lines().next().unwrap_or("");
    let mut out = Vec::with_capacity(9 + line.len());
    out.extend_from_slice(REPLY);
    out.push(1);
    out.extend_from_slice(&(line.len() as u32).to_le_bytes());
    out.extend_from_slice(line.as_bytes());
    s.write_all(&out)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// What the decode worker answered, with the sender's own send time.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    /// Greedy tokens.
    pub tokens: Vec<i64>,
    /// Worker: first envelope byte to last frame byte.
    pub receive: Duration,
    /// Worker: parse, verify, dequantize into the cache.
    pub unpack: Duration,
    /// Worker: the first decode step.
    pub first_step: Duration,
    /// SHA-256 of the worker's restored KV.
    pub fingerprint: [u8; 32],
    /// Sender: writing the request.
    pub send: Duration,
    /// Sender: from the first byte written to the reply read.
    pub round_trip: Duration,
}

/// Send `frame` (a [`wire`] frame) with the first token to feed and the greedy steps wanted;
/// `mbps` (megabits per second) paces the writes.
pub fn request(
    stream: &mut TcpStream,
    frame: &[u8],
    first_token: i64,
    steps: u32,
    mbps: Option<f64>,
) -> Result<Reply> {
    let mut env = Vec::with_capacity(ENVELOPE);
    env.extend_from_slice(REQUEST);
    env.extend_from_slice(&VERSION.to_le_bytes());
    env.extend_from_slice(&[0, 0]);
    env.extend_from_slice(&(first_token as u32).to_le_bytes());
    env.extend_from_slice(&steps.to_le_bytes());
    env.extend_from_slice(&(frame.len() as u64).to_le_bytes());
    let t0 = Instant::now();
    write_paced(stream, &env, frame, mbps)?;
    let send = t0.elapsed();
    let r = read_reply(stream)?;
    Ok(Reply {
        send,
        round_trip: t0.elapsed(),
        ..r
    })
}

/// Write the envelope and the frame, at most `mbps` megabits per second when given.
fn write_paced(s: &mut TcpStream, env: &[u8], frame: &[u8], mbps: Option<f64>) -> Result<()> {
    s.write_all(env).map_err(|e| net("send", e))?;
    let Some(rate) = mbps.filter(|r| *r > 0.0) else {
        return s.write_all(frame).map_err(|e| net("send", e));
    };
    let bytes_per_s = rate * 1e6 / 8.0;
    let t0 = Instant::now();
    let mut sent = env.len();
    for chunk in frame.chunks(64 * 1024) {
        s.write_all(chunk).map_err(|e| net("send", e))?;
        sent += chunk.len();
        let due = Duration::from_secs_f64(sent as f64 / bytes_per_s);
        if let Some(wait) = due.checked_sub(t0.elapsed()) {
            std::thread::sleep(wait);
        }
    }
    Ok(())
}

fn read_reply(s: &mut TcpStream) -> Result<Reply> {
    let mut head = [0u8; 5];
    s.read_exact(&mut head).map_err(|e| net("reply", e))?;
    if &head[..4] != REPLY {
        return Err(Error::Spectrum("not a SpectrumKV reply".into()));
    }
    let mut u32buf = [0u8; 4];
    s.read_exact(&mut u32buf).map_err(|e| net("reply", e))?;
    let n = u32::from_le_bytes(u32buf) as usize;
    if head[4] != 0 {
        let mut msg = vec![0u8; n.min(4096)];
        s.read_exact(&mut msg).map_err(|e| net("reply", e))?;
        return Err(Error::Spectrum(format!(
            "decode worker: {}",
            String::from_utf8_lossy(&msg)
        )));
    }
    if n == 0 || n > MAX_STEPS as usize {
        return Err(Error::Spectrum(format!("reply with {n} tokens")));
    }
    let mut rest = vec![0u8; 4 * n + 24 + 32];
    s.read_exact(&mut rest).map_err(|e| net("reply", e))?;
    let tokens = rest[..4 * n]
        .chunks(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4")) as i64)
        .collect();
    let ns = |i: usize| {
        let o = 4 * n + 8 * i;
        Duration::from_nanos(u64::from_le_bytes(rest[o..o + 8].try_into().expect("8")))
    };
    let mut fingerprint = [0u8; 32];
    fingerprint.copy_from_slice(&rest[4 * n + 24..]);
    Ok(Reply {
        tokens,
        receive: ns(0),
        unpack: ns(1),
        first_step: ns(2),
        fingerprint,
        send: Duration::ZERO,
        round_trip: Duration::ZERO,
    })
}
