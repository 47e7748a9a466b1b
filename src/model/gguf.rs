//! A GGUF checkpoint as a runnable model: the decoder configuration and tensors the
//! [`crate::gguf`] mapping reads, and the tokenizer [`crate::tokenizer::from_gguf`] rebuilds
//! from the same file.
use super::{Decoder, Weights};
use crate::Result;
use crate::config::ArchConfig;
use crate::gguf::{GgufFile, config_from_gguf, load_tensors};
use std::path::Path;
use tch::{Device, Kind, Tensor};

/// Everything needed to run a GGUF checkpoint.
pub struct GgufModel {
    /// Architecture read from the metadata.
    pub config: ArchConfig,
    /// Float32 CPU tensors under Hugging Face names (`lm_head.weight` absent when tied).
    pub tensors: Vec<(String, Tensor)>,
    /// Tokenizer rebuilt from the metadata.
    pub tokenizer: tokenizers::Tokenizer,
    /// Jinja chat template (`tokenizer.chat_template`), if the file has one.
    pub chat_template: Option<String>,
    /// Beginning-of-sequence id.
    pub bos_token_id: Option<u32>,
    /// End-of-generation ids, EOS first.
    pub eos_token_ids: Vec<u32>,
    /// Whether plain text should start with BOS (`encode(text, true)` adds it).
    pub add_bos: bool,
}

impl GgufModel {
    /// Move the tensors into a [`Decoder`] of the given dtype/device (the tensor list is left
    /// empty; tokenizer and template stay available).
    pub fn take_decoder(&mut self, kind: Kind, device: Device) -> Result<Decoder> {
        let tensors = std::mem::take(&mut self.tensors);
        Decoder::from_weights(
            self.config.clone(),
            Weights::from_named(tensors, kind, device),
        )
    }
}

/// Read a GGUF file: configuration, de-quantized tensors, tokenizer and chat template.
pub fn load(path: &Path) -> Result<GgufModel> {
    let g = GgufFile::open(path)?;
    let tok = crate::tokenizer::from_gguf(&g)?;
    let mut config = config_from_gguf(&g)?;
    config.bos_token_id = tok.bos_token_id;
    config.eos_token_ids = tok.eos_token_ids.clone();
    let tensors = load_tensors(&g, &config)?;
    Ok(GgufModel {
        config,
        tensors,
        tokenizer: tok.tokenizer,
        chat_template: tok.chat_template,
        bos_token_id: tok.bos_token_id,
        eos_token_ids: tok.eos_token_ids,
        add_bos: tok.add_bos,
    })
}
