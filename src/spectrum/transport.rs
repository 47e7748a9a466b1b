//! TCP transport between a prefill worker and a decode worker.
//!
//! A request is an envelope — magic `SPRQ`, version u16, reserved u16, the first token to
//! feed (u32), greedy steps (u32), the frame's length (u64) — followed by a [`super::wire`]
//! frame. The reply is `SPRS`, a status byte, then either (ok) the generated tokens (u32
//! count, u32 each), the worker's timings in nanoseconds (receive, unpack/dequantize, first
//! decode step; u64 each) and the SHA-256 of the restored KV (32 bytes), or (error) a u32
//! length and a one-line message. Frames above the worker's limit are refused before they are
//! read, and a frame's buffer grows only as its bytes arrive; any bad request gets an error
//! reply and a log line, and the worker keeps serving. Connections are read concurrently (up
//! to a cap), each request within a whole-request deadline.
use super::tiers::TieredKv;
use super::wire;
use crate::exec::ExecPolicy;
use crate::model::{Decoder, LogitsAt};
use crate::{Error, Result};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
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
    /// Whole-request deadline: a request whose last byte has not arrived this long after its
    /// first is refused (a client trickling bytes cannot hold its connection either).
    pub request_timeout: Duration,
    /// Most connections open at once; one more is refused with an error reply.
    pub max_connections: usize,
    /// Execution policy of the decoder.
    pub policy: ExecPolicy,
}

impl ServeOptions {
    /// Refuse settings under which the worker could not serve anyone: zero timeouts, no
    /// connections, a zero frame limit.
    pub fn check(&self) -> Result<()> {
        let bad = |m: &str| Err(Error::Spectrum(format!("serve: {m}")));
        if self.read_timeout.is_zero() {
            return bad("the read timeout must be positive");
        }
        if self.request_timeout.is_zero() {
            return bad("the request timeout must be positive");
        }
        if self.max_connections == 0 {
            return bad("max connections must be at least 1");
        }
        if self.max_frame == 0 {
            return bad("the frame limit must be positive");
        }
        Ok(())
    }
}

/// Bytes read per `read` call of a frame: the frame buffer grows as bytes arrive, never
/// from the length a client claims.
const FRAME_CHUNK: usize = 1 << 20;
/// How often blocked reads and the accept loop look at the clock and the stop flag.
const POLL: Duration = Duration::from_millis(50);

/// What the connection threads pass to the decoding thread.
enum Event {
    /// A whole request, the connection to answer on, and where to say whether the
    /// connection stays open.
    Request(Received, TcpStream, mpsc::Sender<bool>),
    /// A request refused while it was read (already answered); counted and logged.
    Rejected(String),
    /// A line for the log that is no request (a refused connection, a failed accept).
    Note(String),
}

/// A request read off the wire, not yet decoded.
struct Received {
    first: u32,
    steps: u32,
    frame: Vec<u8>,
    receive: Duration,
}

/// What a connection thread needs to read requests (everything but the model).
#[derive(Clone, Copy)]
struct Limits {
    max_frame: u64,
    read_timeout: Duration,
    request_timeout: Duration,
    vocab: usize,
}

/// Serve requests on `listener` until `max_requests`; `log` gets one line per request.
///
/// Each connection is read on its own thread, up to `max_connections` at once, and whole
/// requests are decoded one at a time on the calling thread (which alone touches the model),
/// so a slow or stalled client delays nobody else. The listener is polled non-blocking while
/// serving and set back to blocking on return.
pub fn serve(
    model: &Decoder,
    listener: &TcpListener,
    opts: &ServeOptions,
    log: &mut dyn FnMut(&str),
) -> Result<()> {
    opts.check()?;
    listener
        .set_nonblocking(true)
        .map_err(|e| net("listener", e))?;
    let limits = Limits {
        max_frame: opts.max_frame,
        read_timeout: opts.read_timeout,
        request_timeout: opts.request_timeout,
        vocab: model.config().vocab_size,
    };
    let stop = AtomicBool::new(false);
    let open = AtomicUsize::new(0);
    let result = std::thread::scope(|scope| {
        let (tx, rx) = mpsc::channel::<Event>();
        let (stop, open) = (&stop, &open);
        let max_connections = opts.max_connections;
        scope.spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let mut stream = match listener.accept() {
                    Ok((s, _)) => s,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(2));
                        continue;
                    }
                    Err(e) => {
                        let _ = tx.send(Event::Note(format!("accept failed: {e}")));
                        std::thread::sleep(POLL);
                        continue;
                    }
                };
                let peer = stream
                    .peer_addr()
                    .map(|a| a.to_string())
                    .unwrap_or_default();
                if open.load(Ordering::Relaxed) >= max_connections {
                    let msg = format!("busy: {max_connections} connections open; try again");
                    let _ = reply_error(&mut stream, &msg);
                    let _ = tx.send(Event::Note(format!("refused {peer}: {msg}")));
                    continue;
                }
                if let Err(e) = stream.set_nonblocking(false) {
                    let _ = tx.send(Event::Note(format!("refused {peer}: {e}")));
                    continue;
                }
                open.fetch_add(1, Ordering::Relaxed);
                let tx = tx.clone();
                scope.spawn(move || {
                    connection(stream, limits, stop, &tx);
                    open.fetch_sub(1, Ordering::Relaxed);
                });
            }
        });
        let r = decode_loop(model, opts, &rx, log);
        stop.store(true, Ordering::Relaxed);
        // Dropping `rx` here lets connection threads waiting on an answer end.
        drop(rx);
        r
    });
    let _ = listener.set_nonblocking(false);
    result
}

/// Decode whole requests as they come until `max_requests` have been answered (or refused).
fn decode_loop(
    model: &Decoder,
    opts: &ServeOptions,
    rx: &mpsc::Receiver<Event>,
    log: &mut dyn FnMut(&str),
) -> Result<()> {
    let mut served = 0usize;
    while opts.max_requests.is_none_or(|m| served < m) {
        let Ok(event) = rx.recv() else {
            return Err(Error::Spectrum("serve: the accept loop stopped".into()));
        };
        match event {
            Event::Note(line) => log(&line),
            Event::Rejected(msg) => {
                served += 1;
                log(&format!("rejected: {msg}"));
            }
            Event::Request(req, mut stream, keep) => {
                served += 1;
                match answer(model, &req, &mut stream, opts) {
                    Ok(line) => {
                        log(&line);
                        let _ = keep.send(true);
                    }
                    Err(e) => {
                        let msg = e.to_string();
                        log(&format!("rejected: {msg}"));
                        let _ = reply_error(&mut stream, &msg);
                        let _ = keep.send(false);
                    }
                }
            }
        }
    }
    Ok(())
}

/// Read requests on one connection until it closes, a request fails or the worker stops;
/// each whole request is handed to the decoding thread and answered before the next is read.
fn connection(mut s: TcpStream, limits: Limits, stop: &AtomicBool, tx: &mpsc::Sender<Event>) {
    loop {
        match read_request(&mut s, &limits, stop) {
            Ok(None) => return,
            Ok(Some(req)) => {
                let Ok(reply_to) = s.try_clone() else { return };
                let (keep_tx, keep_rx) = mpsc::channel();
                if tx.send(Event::Request(req, reply_to, keep_tx)).is_err() {
                    return;
                }
                if keep_rx.recv() != Ok(true) {
                    return;
                }
            }
            Err(e) => {
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                let msg = e.to_string();
                let _ = reply_error(&mut s, &msg);
                let _ = tx.send(Event::Rejected(msg));
                return;
            }
        }
    }
}

fn net(what: &str, e: std::io::Error) -> Error {
    Error::Spectrum(format!("{what}: {e}"))
}

/// Fill `buf` from `s`, failing when nothing arrives for `idle`, when `deadline` passes, or
/// when the worker stops; reads wake every [`POLL`] to look.
fn read_full(
    s: &mut TcpStream,
    buf: &mut [u8],
    idle: Duration,
    deadline: Instant,
    stop: &AtomicBool,
) -> std::io::Result<()> {
    let mut got = 0;
    let mut last = Instant::now();
    while got < buf.len() {
        let now = Instant::now();
        if stop.load(Ordering::Relaxed) {
            return Err(std::io::Error::other("worker stopping"));
        }
        if now >= deadline {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "request deadline passed",
            ));
        }
        if now.duration_since(last) >= idle {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "read timed out",
            ));
        }
        let wait = POLL.min(deadline - now).max(Duration::from_millis(1));
        s.set_read_timeout(Some(wait))?;
        match s.read(&mut buf[got..]) {
            Ok(0) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "connection closed",
                ));
            }
            Ok(k) => {
                got += k;
                last = Instant::now();
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// One request off the wire: `Ok(None)` when the peer closed before sending one. The
/// envelope is checked before the frame is read, and the frame is read in chunks of at most
/// [`FRAME_CHUNK`] bytes, all within the whole-request deadline.
fn read_request(s: &mut TcpStream, limits: &Limits, stop: &AtomicBool) -> Result<Option<Received>> {
    let mut env = [0u8; ENVELOPE];
    // The first byte tells an idle close from a request.
    let far = Instant::now() + limits.read_timeout + POLL;
    match read_full(s, &mut env[..1], limits.read_timeout, far, stop) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(net("read", e)),
    }
    let t0 = Instant::now();
    let deadline = t0 + limits.request_timeout;
    read_full(s, &mut env[1..], limits.read_timeout, deadline, stop)
        .map_err(|e| net("truncated request envelope", e))?;
    if &env[..4] != REQUEST || u16::from_le_bytes([env[4], env[5]]) != VERSION {
        return Err(Error::Spectrum("not a version-1 SpectrumKV request".into()));
    }
    let first = u32::from_le_bytes(env[8..12].try_into().expect("4"));
    let steps = u32::from_le_bytes(env[12..16].try_into().expect("4"));
    let len = u64::from_le_bytes(env[16..24].try_into().expect("8"));
    if len > limits.max_frame {
        return Err(Error::Spectrum(format!(
            "frame of {len} bytes exceeds the limit of {}",
            limits.max_frame
        )));
    }
    if steps == 0 || steps > MAX_STEPS || first as usize >= limits.vocab {
        return Err(Error::Spectrum(format!(
            "bad request: token {first}, {steps} steps"
        )));
    }
    let len = usize::try_from(len)
        .map_err(|_| Error::Spectrum(format!("frame of {len} bytes is too large here")))?;
    let mut frame = Vec::new();
    while frame.len() < len {
        let at = frame.len();
        let k = (len - at).min(FRAME_CHUNK);
        frame.resize(at + k, 0);
        read_full(s, &mut frame[at..], limits.read_timeout, deadline, stop).map_err(|e| {
            net(
                &format!("truncated frame (expected {len} bytes, got {at}+)"),
                e,
            )
        })?;
    }
    Ok(Some(Received {
        first,
        steps,
        frame,
        receive: t0.elapsed(),
    }))
}

/// Decode one whole request and write the reply; the log line on success.
fn answer(
    model: &Decoder,
    req: &Received,
    s: &mut TcpStream,
    opts: &ServeOptions,
) -> Result<String> {
    let len = req.frame.len();
    let receive = req.receive;
    let t1 = Instant::now();
    let tiered = wire::decode(&req.frame)?;
    let parse = t1.elapsed();
    let (tokens, unpack, step, fingerprint) = decode_greedy(
        model,
        &tiered,
        req.first as i64,
        req.steps as usize,
        &opts.policy,
    )?;
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
    Ok(format!(
        "served {len} bytes ({} tokens, {} dropped): first token {} [receive {:.1} ms, unpack {:.1} ms, step {:.1} ms]",
        tiered.len,
        tiered.dropped().len(),
        tokens[0],
        ms(receive),
        ms(unpack),
        ms(step)
    ))
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
