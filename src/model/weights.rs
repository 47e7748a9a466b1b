//! Checkpoint tensors by Hugging Face key: loading (single or sharded safetensors), shape
//! checks, conversion to the run dtype/device, and a report of keys nobody used.
use crate::{Error, Result};
use std::collections::HashMap;
use std::path::Path;
use tch::{Device, Kind, Tensor};

/// Named checkpoint tensors, consumed by key as the model is built.
pub struct Weights {
    tensors: HashMap<String, Tensor>,
    pub(crate) kind: Kind,
    pub(crate) device: Device,
}

impl Weights {
    /// Wrap already-loaded tensors (e.g. de-quantized GGUF tensors under HF names).
    pub fn from_named(named: Vec<(String, Tensor)>, kind: Kind, device: Device) -> Weights {
        Weights {
            tensors: named.into_iter().collect(),
            kind,
            device,
        }
    }

    /// Load every `*.safetensors` file of a Hugging Face directory (single or sharded; the
    /// index file, when present, must name only shards that exist).
    pub fn from_safetensors_dir(dir: &Path, kind: Kind, device: Device) -> Result<Weights> {
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<std::path::PathBuf> = if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| Error::Weights(format!("{}: invalid JSON: {e}", index.display())))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| Error::Weights(format!("{}: no `weight_map`", index.display())))?;
            let mut shards: Vec<String> = map
                .values()
                .filter_map(|s| s.as_str().map(str::to_string))
                .collect();
            shards.sort();
            shards.dedup();
            shards.into_iter().map(|s| dir.join(s)).collect()
        } else {
            let single = dir.join("model.safetensors");
            if !single.exists() {
                return Err(Error::Weights(format!(
                    "{}: no model.safetensors or model.safetensors.index.json",
                    dir.display()
                )));
            }
            vec![single]
        };
        let mut named = Vec::new();
        for file in &files {
            if !file.exists() {
                return Err(Error::Weights(format!("missing shard {}", file.display())));
            }
            let tensors = Tensor::read_safetensors(file).map_err(|e| {
                let msg = e.to_string();
                Error::Weights(format!(
                    "{}: cannot read safetensors (truncated or corrupt?): {}",
                    file.display(),
                    msg.lines().next().unwrap_or("")
                ))
            })?;
            named.extend(tensors);
        }
        Ok(Weights::from_named(named, kind, device))
    }

    /// The same tensors, converted to `kind` on `device` as they are taken.
    pub fn with_target(self, kind: Kind, device: Device) -> Weights {
        Weights {
            kind,
            device,
            ..self
        }
    }

    /// Whether a key is present.
    pub fn contains(&self, key: &str) -> bool {
        self.tensors.contains_key(key)
    }

    /// Remove `key`, check its shape, and convert it to the run dtype and device.
    pub fn take(&mut self, key: &str, shape: &[i64]) -> Result<Tensor> {
        self.take_as(key, shape, self.kind)
    }

    /// Like [`Self::take`] but converting to `kind`.
    pub fn take_as(&mut self, key: &str, shape: &[i64], kind: Kind) -> Result<Tensor> {
        let t = self
            .tensors
            .remove(key)
            .ok_or_else(|| Error::Weights(format!("missing tensor `{key}`")))?;
        if t.size() != shape {
            return Err(Error::Weights(format!(
                "tensor `{key}` has shape {:?}, expected {shape:?}",
                t.size()
            )));
        }
        if !matches!(
            t.kind(),
            Kind::Float | Kind::Half | Kind::BFloat16 | Kind::Double
        ) {
            return Err(Error::Weights(format!(
                "tensor `{key}` has dtype {:?}, expected a floating-point type",
                t.kind()
            )));
        }
        Ok(t.f_to_device(self.device)?.f_to_kind(kind)?)
    }

    /// Keys that were never taken, sorted.
    pub fn unused(&self) -> Vec<String> {
        let mut keys: Vec<String> = self.tensors.keys().cloned().collect();
        keys.sort();
        keys
    }
}
