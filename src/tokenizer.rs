//! Tokenizers for real checkpoints: a Hugging Face `tokenizer.json`, or one rebuilt from the
//! vocabulary a GGUF file stores in its metadata, reproducing llama.cpp's tokenization.
//!
//! Two GGUF tokenizer models are supported (`tokenizer.ggml.model`):
//! - `gpt2`: byte-level BPE with the file's merges; the split regex is chosen by
//!   `tokenizer.ggml.pre` exactly as llama.cpp's `llama-vocab.cpp` chooses it (`qwen2`,
//!   `smollm`/`starcoder`/`refact`, `gpt-2`, `llama-bpe`, ...). Qwen2 vocabularies also get
//!   Hugging Face's NFC normalizer.
//! - `llama`: SentencePiece BPE (LLaMA-2, Gemma): spaces become `▁` (with a leading `▁` when
//!   `tokenizer.ggml.add_space_prefix` is set, the default), no pre-split, symbols merged best
//!   score first, unknown characters fall back to `<0xXX>` byte tokens. The merge list is derived
//!   from the scores: each normal token that splits into two vocabulary pieces yields a merge
//!   ranked by its score.
//!
//! Control tokens (`token_type` 3) become added *special* tokens and user-defined tokens (4)
//! added non-special tokens; both are matched on the raw text before normalization, as
//! llama.cpp's `tokenizer_st_partition` does for user-defined tokens. Note llama.cpp (and its
//! tests) tokenizes with `parse_special = false` by default, while a `tokenizers::Tokenizer`
//! always recognizes special-token text.
//!
//! Encoding with `add_special_tokens = true` prepends BOS when the file says so
//! (`tokenizer.ggml.add_bos_token`; SentencePiece vocabularies default to yes, as in llama.cpp).
//! Text rendered by a chat template already carries its BOS: encode it with
//! `add_special_tokens = false`.
use crate::gguf::reader::{GgufFile, Value};
use crate::{Error, Result};
use serde_json::json;
use std::collections::HashMap;
use std::path::Path;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
    Tokenizer,
};

/// llama.cpp token types (`tokenizer.ggml.token_type`).
const TYPE_NORMAL: i32 = 1;
const TYPE_UNKNOWN: i32 = 2;
const TYPE_CONTROL: i32 = 3;
const TYPE_USER_DEFINED: i32 = 4;

/// Qwen2's split regex (its `tokenizer.json`; llama.cpp `LLAMA_VOCAB_PRE_TYPE_QWEN2`).
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// LLaMA-3's split regex (llama.cpp `LLAMA_VOCAB_PRE_TYPE_LLAMA3`).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Token texts llama.cpp treats as end-of-generation when the vocabulary marks them control.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<EOT>",
    "<|return|>",
    "<|call|>",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];

/// A tokenizer with the special-token facts a generation loop needs.
pub struct TokenizerInfo {
    /// The tokenizer proper.
    pub tokenizer: Tokenizer,
    /// Beginning-of-sequence id, if the vocabulary has one.
    pub bos_token_id: Option<u32>,
    /// End-of-generation ids: the EOS id first, then EOT/EOM and other end-of-turn control
    /// tokens (llama.cpp's EOG set, e.g. `<|im_end|>`, `<|endoftext|>`, `<end_of_turn>`).
    pub eos_token_ids: Vec<u32>,
    /// Whether `encode(text, true)` prepends BOS.
    pub add_bos: bool,
    /// Text of the BOS token (for chat templates).
    pub bos_token: Option<String>,
    /// Text of the EOS token (for chat templates).
    pub eos_token: Option<String>,
    /// The Jinja chat template stored in the file, if any.
    pub chat_template: Option<String>,
}

/// Load a Hugging Face `tokenizer.json`.
pub fn from_file(path: &Path) -> Result<Tokenizer> {
    if !path.exists() {
        return Err(Error::io(
            path,
            std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
        ));
    }
    Tokenizer::from_file(path)
        .map_err(|e| Error::Tokenizer(format!("{}: {}", path.display(), one_line(&e.to_string()))))
}

/// Build the tokenizer described by a GGUF file's metadata (the tensors are not read).
pub fn from_gguf_path(path: &Path) -> Result<TokenizerInfo> {
    from_gguf(&GgufFile::open(path)?)
}

/// Build the tokenizer described by a parsed GGUF file's metadata.
pub fn from_gguf(g: &GgufFile) -> Result<TokenizerInfo> {
    from_gguf_inner(g).map_err(|e| match e {
        Error::Tokenizer(m) => Error::Tokenizer(format!("{}: {m}", g.path().display())),
        other => other,
    })
}

fn one_line(s: &str) -> String {
    s.lines().next().unwrap_or("").to_string()
}

fn tk(e: impl std::fmt::Display) -> Error {
    Error::Tokenizer(one_line(&e.to_string()))
}

fn from_gguf_inner(g: &GgufFile) -> Result<TokenizerInfo> {
    let model = g
        .opt_str("tokenizer.ggml.model")?
        .ok_or_else(|| Error::Tokenizer("no `tokenizer.ggml.model` in the file".into()))?;
    let tokens = g
        .opt_str_array("tokenizer.ggml.tokens")?
        .ok_or_else(|| Error::Tokenizer("no `tokenizer.ggml.tokens` in the file".into()))?;
    let n = tokens.len();
    let types = g
        .opt_array(
            "tokenizer.ggml.token_type",
            |v| match *v {
                Value::I32(x) => Some(x),
                _ => v.as_u64().map(|x| x as i32),
            },
            "integers",
        )?
        .unwrap_or_else(|| vec![TYPE_NORMAL; n]);
    if types.len() != n {
        return Err(Error::Tokenizer(format!(
            "`tokenizer.ggml.token_type` has {} entries for {n} tokens",
            types.len()
        )));
    }
    let id = |key: &str| -> Result<Option<u32>> {
        match g.opt_u64(key)? {
            Some(i) if (i as usize) < n => Ok(Some(i as u32)),
            Some(i) => Err(Error::Tokenizer(format!(
                "`{key}` = {i} is outside the vocabulary of {n}"
            ))),
            None => Ok(None),
        }
    };
    let bos = id("tokenizer.ggml.bos_token_id")?;
    let eos = id("tokenizer.ggml.eos_token_id")?;
    let unk = id("tokenizer.ggml.unknown_token_id")?;
    let eot = id("tokenizer.ggml.eot_token_id")?;
    let eom = id("tokenizer.ggml.eom_token_id")?;

    // Vocabulary: on duplicate texts the last id wins, as in llama.cpp's `token_to_id`.
    let mut vocab: HashMap<String, u32> = HashMap::with_capacity(n);
    for (i, t) in tokens.iter().enumerate() {
        vocab.insert((*t).to_string(), i as u32);
    }

    let spm = match model {
        "gpt2" => false,
        "llama" => true,
        other => {
            return Err(Error::Tokenizer(format!(
                "unsupported tokenizer model `{other}` (supported: gpt2, llama)"
            )));
        }
    };
    let add_bos = g.opt_bool("tokenizer.ggml.add_bos_token")?.unwrap_or(spm) && bos.is_some();
    let add_eos = g.opt_bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false) && eos.is_some();

    let mut tokenizer = if spm {
        let add_space_prefix = g
            .opt_bool("tokenizer.ggml.add_space_prefix")?
            .unwrap_or(true);
        let scores = g
            .opt_array("tokenizer.ggml.scores", Value::as_f64, "numbers")?
            .ok_or_else(|| {
                Error::Tokenizer("SentencePiece vocabulary without `tokenizer.ggml.scores`".into())
            })?;
        if scores.len() != n {
            return Err(Error::Tokenizer(format!(
                "`tokenizer.ggml.scores` has {} entries for {n} tokens",
                scores.len()
            )));
        }
        build_spm(
            &tokens,
            &types,
            &scores,
            vocab,
            unk.map(|u| tokens[u as usize]),
            add_space_prefix,
        )?
    } else {
        let pre = g.opt_str("tokenizer.ggml.pre")?.unwrap_or("default");
        let merges = g.opt_str_array("tokenizer.ggml.merges")?.ok_or_else(|| {
            Error::Tokenizer("byte-level BPE vocabulary without `tokenizer.ggml.merges`".into())
        })?;
        build_byte_level(vocab, &merges, pre)?
    };

    // Control/unknown tokens as special added tokens, user-defined ones as plain added tokens.
    let special: Vec<AddedToken> = tokens
        .iter()
        .zip(&types)
        .filter(|(t, ty)| matches!(**ty, TYPE_CONTROL | TYPE_UNKNOWN) && !t.is_empty())
        .map(|(t, _)| AddedToken::from(*t, true).normalized(false))
        .collect();
    tokenizer.add_special_tokens(special).map_err(tk)?;
    let user: Vec<AddedToken> = tokens
        .iter()
        .zip(&types)
        .filter(|(t, ty)| **ty == TYPE_USER_DEFINED && !t.is_empty())
        .map(|(t, _)| AddedToken::from(*t, false).normalized(false))
        .collect();
    tokenizer.add_tokens(user).map_err(tk)?;

    if let Some(post) = template_post_processor(&tokens, (add_bos, bos), (add_eos, eos))? {
        tokenizer.with_post_processor(Some(post));
    }

    // End-of-generation set, EOS first.
    let extra = EOG_TEXTS
        .iter()
        .filter_map(|t| tokens.iter().position(|x| x == t))
        .filter(|&i| types[i] == TYPE_CONTROL)
        .map(|i| i as u32);
    let eos_ids = end_of_generation([eos, eot, eom].into_iter().flatten(), extra);

    Ok(TokenizerInfo {
        tokenizer,
        bos_token_id: bos,
        eos_token_ids: eos_ids,
        add_bos,
        bos_token: bos.map(|b| tokens[b as usize].to_string()),
        eos_token: eos.map(|e| tokens[e as usize].to_string()),
        chat_template: g.opt_str("tokenizer.chat_template")?.map(str::to_string),
    })
}

/// The template that adds BOS and/or EOS around one sequence or a pair (`None` when neither
/// is added).
fn template_post_processor(
    tokens: &[&str],
    (add_bos, bos): (bool, Option<u32>),
    (add_eos, eos): (bool, Option<u32>),
) -> Result<Option<PostProcessorWrapper>> {
    if !(add_bos || add_eos) {
        return Ok(None);
    }
    let text = |i: u32| tokens[i as usize].to_string();
    let mut single = Vec::new();
    let mut pair = Vec::new();
    let mut specials = Vec::new();
    if let (true, Some(b)) = (add_bos, bos) {
        single.push(text(b));
        pair.push(text(b));
        specials.push(json!({"id": text(b), "ids": [b], "tokens": [text(b)]}));
    }
    single.push("$A".to_string());
    pair.push("$A".to_string());
    if let (true, Some(e)) = (add_eos, eos) {
        single.push(text(e));
        pair.push(text(e));
        if !add_bos || Some(e) != bos {
            specials.push(json!({"id": text(e), "ids": [e], "tokens": [text(e)]}));
        }
    }
    if let (true, Some(b)) = (add_bos, bos) {
        pair.push(text(b));
    }
    pair.push("$B:1".to_string());
    if let (true, Some(e)) = (add_eos, eos) {
        pair.push(text(e));
    }
    let specials: serde_json::Map<String, serde_json::Value> = specials
        .into_iter()
        .map(|s| (s["id"].as_str().unwrap_or_default().to_string(), s))
        .collect();
    let post: PostProcessorWrapper = serde_json::from_value(json!({
        "type": "TemplateProcessing",
        "single": single.iter().map(|p| piece(p)).collect::<Vec<_>>(),
        "pair": pair.iter().map(|p| piece(p)).collect::<Vec<_>>(),
        "special_tokens": specials,
    }))
    .map_err(tk)?;
    Ok(Some(post))
}

/// An end-of-generation set: `first` in order, then the other ids of `extra` ascending; no
/// duplicates.
fn end_of_generation(
    first: impl IntoIterator<Item = u32>,
    extra: impl Iterator<Item = u32>,
) -> Vec<u32> {
    let mut ids: Vec<u32> = Vec::new();
    for i in first {
        if !ids.contains(&i) {
            ids.push(i);
        }
    }
    let mut extra: Vec<u32> = extra.filter(|i| !ids.contains(i)).collect();
    extra.sort_unstable();
    extra.dedup();
    ids.extend(extra);
    ids
}

/// Ids of the tokenizer's special tokens, ascending: a GGUF vocabulary's control and unknown
/// tokens (see [`from_gguf`]), a `tokenizer.json`'s added tokens marked `special`.
pub fn special_token_ids(tokenizer: &Tokenizer) -> Vec<u32> {
    let mut ids: Vec<u32> = tokenizer
        .get_added_tokens_decoder()
        .into_iter()
        .filter(|(_, t)| t.special)
        .map(|(i, _)| i)
        .collect();
    ids.sort_unstable();
    ids
}

/// End-of-generation ids of a Hugging Face checkpoint: `eos` (its config's `eos_token_id`)
/// first, then the tokenizer's special tokens whose text is an end-of-turn marker (the set
/// llama.cpp uses for GGUF files: `<|im_end|>`, `<|endoftext|>`, `<end_of_turn>`, ...).
pub fn hf_stop_token_ids(eos: &[u32], tokenizer: &Tokenizer) -> Vec<u32> {
    let extra = tokenizer
        .get_added_tokens_decoder()
        .into_iter()
        .filter(|(_, t)| t.special && EOG_TEXTS.contains(&t.content.as_str()))
        .map(|(i, _)| i);
    end_of_generation(eos.iter().copied(), extra)
}

/// One piece of a `TemplateProcessing` template in its JSON form.
fn piece(p: &str) -> serde_json::Value {
    match p {
        "$A" => json!({"Sequence": {"id": "A", "type_id": 0}}),
        "$B:1" => json!({"Sequence": {"id": "B", "type_id": 1}}),
        tok => json!({"SpecialToken": {"id": tok, "type_id": 0}}),
    }
}

fn from_json<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> Result<T> {
    serde_json::from_value(v).map_err(tk)
}

/// Byte-level BPE (GPT-2 family) with the split regex llama.cpp uses for `pre`.
fn build_byte_level(vocab: HashMap<String, u32>, merges: &[&str], pre: &str) -> Result<Tokenizer> {
    let merges = merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| {
                    Error::Tokenizer(format!("malformed merge `{m}` (expected two pieces)"))
                })
        })
        .collect::<Result<Vec<_>>>()?;
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": use_regex});
    let split = |re: &str| json!({"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false});
    let (pre_tok, normalizer, ignore_merges) = match pre {
        "qwen2" | "deepseek-r1-qwen" | "stablelm2" | "hunyuan" | "megrez" => (
            json!({"type": "Sequence", "pretokenizers": [split(QWEN2_SPLIT), byte_level(false)]}),
            Some(json!({"type": "NFC"})),
            false,
        ),
        "llama3" | "llama-v3" | "llama-bpe" => (
            json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_SPLIT), byte_level(false)]}),
            None,
            true,
        ),
        "dbrx" | "smaug-bpe" | "falcon3" => (
            json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_SPLIT), byte_level(false)]}),
            None,
            false,
        ),
        // llama.cpp: "\p{N}" isolated, then the GPT-2 regex.
        "smollm" | "starcoder" | "refact" | "codeshell" | "command-r" | "exaone" | "minerva" => (
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
            None,
            false,
        ),
        "default" | "gpt-2" | "gpt2" | "mpt" | "olmo" | "jais" | "trillion" => {
            (byte_level(true), None, false)
        }
        other => {
            return Err(Error::Tokenizer(format!(
                "unsupported pre-tokenizer `{other}` (tokenizer.ggml.pre); supported: qwen2, smollm, starcoder, refact, gpt-2, llama-bpe, default"
            )));
        }
    };
    let bpe = BPE::builder()
        .vocab_and_merges(vocab.into_iter().collect::<Vocab>(), merges)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(tk)?;
    let mut t = Tokenizer::new(bpe);
    if let Some(nrm) = normalizer {
        t.with_normalizer(Some(from_json::<NormalizerWrapper>(nrm)?))
            .map_err(tk)?;
    }
    t.with_pre_tokenizer(Some(from_json::<PreTokenizerWrapper>(pre_tok)?));
    t.with_decoder(Some(from_json::<DecoderWrapper>(
        json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}),
    )?));
    Ok(t)
}

/// SentencePiece-style BPE as llama.cpp's `llm_tokenizer_spm` runs it.
fn build_spm(
    tokens: &[&str],
    types: &[i32],
    scores: &[f64],
    vocab: HashMap<String, u32>,
    unk: Option<&str>,
    add_space_prefix: bool,
) -> Result<Tokenizer> {
    // Every normal token that is the concatenation of two vocabulary entries yields a merge;
    // llama.cpp merges the adjacent pair whose result scores highest, so rank by score
    // (descending), then as transformers' `generate_merges` does.
    struct Cand {
        score: f64,
        left_len: usize,
        right_len: usize,
        left_id: u32,
        right_id: u32,
        token: u32,
        left: usize,
    }
    let mut cands: Vec<Cand> = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        if types[i] != TYPE_NORMAL || vocab.get(*t) != Some(&(i as u32)) {
            continue;
        }
        for (pos, _) in t.char_indices().skip(1) {
            let (l, r) = t.split_at(pos);
            if let (Some(&li), Some(&ri)) = (vocab.get(l), vocab.get(r)) {
                cands.push(Cand {
                    score: scores[i],
                    left_len: l.chars().count(),
                    right_len: r.chars().count(),
                    left_id: li,
                    right_id: ri,
                    token: i as u32,
                    left: pos,
                });
            }
        }
    }
    cands.sort_by(|a, b| {
        b.score
            .total_cmp(&a.score)
            .then(b.left_len.cmp(&a.left_len))
            .then(b.right_len.cmp(&a.right_len))
            .then(a.token.cmp(&b.token))
            .then(a.left_id.cmp(&b.left_id))
            .then(a.right_id.cmp(&b.right_id))
    });
    let merges: Vec<(String, String)> = cands
        .iter()
        .map(|c| {
            let t = tokens[c.token as usize];
            (t[..c.left].to_string(), t[c.left..].to_string())
        })
        .collect();
    let mut b = BPE::builder()
        .vocab_and_merges(vocab.into_iter().collect::<Vocab>(), merges)
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(u) = unk {
        b = b.unk_token(u.to_string());
    }
    let bpe = b.build().map_err(tk)?;
    let mut t = Tokenizer::new(bpe);
    let replace = json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"});
    let normalizer = if add_space_prefix {
        json!({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u{2581}"}, replace]})
    } else {
        replace
    };
    t.with_normalizer(Some(from_json::<NormalizerWrapper>(normalizer)?))
        .map_err(tk)?;
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if add_space_prefix {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    t.with_decoder(Some(from_json::<DecoderWrapper>(
        json!({"type": "Sequence", "decoders": decoders}),
    )?));
    Ok(t)
}
