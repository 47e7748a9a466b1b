//! Chat-template rendering with MiniJinja, configured like Hugging Face transformers'
//! `apply_chat_template`: `trim_blocks` and `lstrip_blocks` on, `{% break %}`/`{% continue %}`,
//! Python string/dict methods (`.strip()`, `.startswith()`, `.items()`, ... via
//! `minijinja-contrib`'s pycompat), a `tojson` that prints like Python's `json.dumps`
//! (`", "`/`": "` separators, no ASCII or HTML escaping), `raise_exception(msg)` and
//! `strftime_now(fmt)`. Variables: `messages`, `add_generation_prompt`, `bos_token`,
//! `eos_token`, plus any extra ones the caller passes (e.g. `tools`).
//!
//! The template comes from a GGUF file (`tokenizer.chat_template`) or a Hugging Face
//! `tokenizer_config.json` (`chat_template`, a string or a list of named templates).
use crate::{Error, Result};
use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Serde, Value};
use minijinja::{Environment, ErrorKind, UndefinedBehavior};
use serde::Serialize;
use std::path::Path;

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role.
    pub fn new(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.to_string(),
            content: content.to_string(),
        }
    }
    /// A system message.
    pub fn system(content: &str) -> ChatMessage {
        Self::new("system", content)
    }
    /// A user message.
    pub fn user(content: &str) -> ChatMessage {
        Self::new("user", content)
    }
    /// An assistant message.
    pub fn assistant(content: &str) -> ChatMessage {
        Self::new("assistant", content)
    }
}

/// A compiled chat template with its special-token texts.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

const NAME: &str = "chat_template";

fn chat_err(e: impl std::fmt::Display) -> Error {
    let s = e.to_string();
    let first = s.lines().next().unwrap_or("").to_string();
    Error::Tokenizer(format!("chat template: {first}"))
}

impl ChatTemplate {
    /// Compile a Jinja chat template. `bos_token`/`eos_token` are the texts the template sees
    /// (empty when absent).
    pub fn new(
        source: &str,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
    ) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_syntax(
            SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .keep_trailing_newline(false)
                .build()
                .map_err(chat_err)?,
        );
        env.set_undefined_behavior(UndefinedBehavior::Lenient);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<Value, minijinja::Error> {
                Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!("raise_exception: {msg}"),
                ))
            },
        );
        env.add_function("strftime_now", |fmt: String| -> String {
            strftime_now(&fmt)
        });
        env.add_template_owned(NAME, source.to_string())
            .map_err(chat_err)?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.unwrap_or("").to_string(),
            eos_token: eos_token.unwrap_or("").to_string(),
        })
    }

    /// Read `chat_template`, `bos_token` and `eos_token` from a Hugging Face
    /// `tokenizer_config.json` (a list of named templates picks `default`).
    pub fn from_tokenizer_config(path: &Path) -> Result<ChatTemplate> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::Tokenizer(format!("{}: invalid JSON: {e}", path.display())))?;
        let template = match v.get("chat_template") {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .or_else(|| list.first())
                .and_then(|t| t.get("template"))
                .and_then(|t| t.as_str())
                .map(str::to_string)
                .ok_or_else(|| {
                    Error::Tokenizer(format!(
                        "{}: no usable `chat_template` entry",
                        path.display()
                    ))
                })?,
            _ => {
                return Err(Error::Tokenizer(format!(
                    "{}: no `chat_template`",
                    path.display()
                )));
            }
        };
        let token = |k: &str| -> Option<String> {
            match v.get(k)? {
                serde_json::Value::String(s) => Some(s.clone()),
                serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
                _ => None,
            }
        };
        ChatTemplate::new(
            &template,
            token("bos_token").as_deref(),
            token("eos_token").as_deref(),
        )
    }

    /// Render a conversation.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, add_generation_prompt, serde_json::Value::Null)
    }

    /// Render any serializable message list, with extra variables (a JSON object, e.g.
    /// `{"tools": [...]}`; `Null` for none).
    pub fn render_with<M: Serialize>(
        &self,
        messages: M,
        add_generation_prompt: bool,
        extra: serde_json::Value,
    ) -> Result<String> {
        let mut ctx = serde_json::Map::new();
        if let serde_json::Value::Object(o) = extra {
            ctx.extend(o);
        } else if !extra.is_null() {
            return Err(Error::Tokenizer(
                "chat template: extra variables must be a JSON object".into(),
            ));
        }
        ctx.insert(
            "messages".into(),
            serde_json::to_value(messages).map_err(chat_err)?,
        );
        ctx.insert("add_generation_prompt".into(), add_generation_prompt.into());
        ctx.insert("bos_token".into(), self.bos_token.clone().into());
        ctx.insert("eos_token".into(), self.eos_token.clone().into());
        let tmpl = self.env.get_template(NAME).map_err(chat_err)?;
        tmpl.render(Value::from(Serde(&ctx))).map_err(chat_err)
    }
}

/// Render `template` once (compiles it each call; keep a [`ChatTemplate`] to reuse).
pub fn render(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: Option<&str>,
    eos_token: Option<&str>,
) -> Result<String> {
    ChatTemplate::new(template, bos_token, eos_token)?.render(messages, add_generation_prompt)
}

/// Largest `tojson` indent accepted.
const MAX_INDENT: usize = 64;

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)`.
fn tojson(value: Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    // Real templates indent by 2 or 4; a huge indent would allocate indent × depth spaces.
    if let Some(n) = indent.filter(|&n| n > MAX_INDENT) {
        return Err(minijinja::Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: indent {n} is more than {MAX_INDENT}"),
        ));
    }
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let (item_sep, key_sep) = match separators {
        Some(s) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        Some(_) => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair",
            ));
        }
        // Python: (', ', ': ') without indent, (',', ': ') with it.
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let json = serde_json::to_value(&value)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    let fmt = PyJson {
        indent,
        item_sep: &item_sep,
        key_sep: &key_sep,
        sort_keys: sort_keys.unwrap_or(false),
    };
    fmt.write(&json, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

struct PyJson<'a> {
    indent: Option<usize>,
    item_sep: &'a str,
    key_sep: &'a str,
    sort_keys: bool,
}

impl PyJson<'_> {
    fn newline(&self, level: usize, out: &mut String) {
        if let Some(n) = self.indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * level));
        }
    }

    fn write(&self, v: &serde_json::Value, level: usize, out: &mut String) {
        use serde_json::Value as J;
        match v {
            J::Null => out.push_str("null"),
            J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            J::Number(n) => {
                // Python prints floats with a fractional part (`1.0`).
                if let Some(f) = n.as_f64().filter(|_| n.is_f64()) {
                    if f.is_finite() && f.fract() == 0.0 && f.abs() < 1e16 {
                        out.push_str(&format!("{f:.1}"));
                    } else {
                        out.push_str(&n.to_string());
                    }
                } else {
                    out.push_str(&n.to_string());
                }
            }
            J::String(s) => out.push_str(&serde_json::to_string(s).unwrap_or_default()),
            J::Array(a) => {
                if a.is_empty() {
                    out.push_str("[]");
                    return;
                }
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    if i > 0 {
                        out.push_str(self.item_sep);
                    }
                    self.newline(level + 1, out);
                    self.write(x, level + 1, out);
                }
                self.newline(level, out);
                out.push(']');
            }
            J::Object(o) => {
                if o.is_empty() {
                    out.push_str("{}");
                    return;
                }
                let mut items: Vec<(&String, &serde_json::Value)> = o.iter().collect();
                if self.sort_keys {
                    items.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, x)) in items.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(self.item_sep);
                    }
                    self.newline(level + 1, out);
                    out.push_str(&serde_json::to_string(k).unwrap_or_default());
                    out.push_str(self.key_sep);
                    self.write(x, level + 1, out);
                }
                self.newline(level, out);
                out.push('}');
            }
        }
    }
}

/// `strftime_now(fmt)` for templates that print today's date (UTC). Supports `%Y %m %d %e
/// %B %b %A %a %H %M %S %%`.
fn strftime_now(fmt: &str) -> String {
    let now = crate::io::UtcTime::now();
    let (year, month, day, tod) = (now.year, now.month, now.day, now.seconds_of_day);
    let weekday = now.weekday;
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
    ];
    let mname = MONTHS[(month - 1) as usize];
    let dname = DAYS[weekday as usize];
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('B') => out.push_str(mname),
            Some('b') => out.push_str(&mname[..3]),
            Some('A') => out.push_str(dname),
            Some('a') => out.push_str(&dname[..3]),
            Some('H') => out.push_str(&format!("{:02}", tod / 3600)),
            Some('M') => out.push_str(&format!("{:02}", tod / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", tod % 60)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_loops_python_methods_and_tojson() -> Result<()> {
        let t = ChatTemplate::new(
            "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}\
             [{{ m.role.upper() }}]{{ m.content.strip() }}{% endfor %}|{{ {'a': [1, 2.0, 'é<']} | tojson }}\
             {% if add_generation_prompt %}|gen{% endif %}",
            None,
            None,
        )?;
        let msgs = [
            ChatMessage::system("  sys "),
            ChatMessage::user("hi\n"),
            ChatMessage::assistant("never"),
        ];
        let s = t.render(&msgs, true)?;
        assert_eq!(s, "[SYSTEM]sys[USER]hi|{\"a\": [1, 2.0, \"é<\"]}|gen");
        Ok(())
    }

    #[test]
    fn template_errors_are_one_clear_line() {
        let err = ChatTemplate::new("{% for x in %}", None, None)
            .err()
            .map(|e| e.to_string());
        let err = err.unwrap_or_default();
        assert!(err.starts_with("tokenizer: chat template:"), "{err}");
        assert!(!err.contains('\n'));
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}", None, None).ok();
        let err = t
            .map(|t| t.render(&[], false))
            .and_then(|r| r.err())
            .map(|e| e.to_string());
        assert!(err.unwrap_or_default().contains("no system role"));
    }
}
