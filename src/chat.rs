//! Chat-template rendering with a Jinja engine (minijinja).
use crate::tasks::Message;
use crate::{Error, Result};

/// Render `messages` with a Hugging Face chat template.
pub fn render(template: &str, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
    let mut env = minijinja::Environment::new();
    env.add_template("chat", template)
        .map_err(|e| Error::Tokenizer(format!("chat template: {e}")))?;
    let tmpl = env
        .get_template("chat")
        .map_err(|e| Error::Tokenizer(format!("chat template: {e}")))?;
    tmpl.render(minijinja::context! { messages => minijinja::Value::from(minijinja::value::Serde(messages)), add_generation_prompt => add_generation_prompt })
        .map_err(|e| Error::Tokenizer(format!("chat template: {e}")))
}
