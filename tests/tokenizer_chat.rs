//! Chat templates from real GGUF files render exactly as transformers' `apply_chat_template`
//! (`tests/fixtures/tokenizer/chat_expected.json`, made by `tests/gen_gguf_reference.py chat`).
mod common;

use kvcredit::chat::{ChatMessage, ChatTemplate};
use kvcredit::tokenizer;
use std::path::Path;

#[test]
fn gguf_templates_render_like_transformers() {
    let fx: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures/tokenizer/chat_expected.json"),
        )
        .expect("chat_expected.json"),
    )
    .expect("json");
    let cases = fx["cases"].as_array().expect("cases");
    assert!(cases.len() >= 6);
    let mut checked = 0;
    for model in ["qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"] {
        let info = tokenizer::from_gguf_path(&common::model_path(model)).expect("tokenizer");
        let source = info.chat_template.as_deref().expect("template in GGUF");
        let tmpl = ChatTemplate::new(source, info.bos_token.as_deref(), info.eos_token.as_deref())
            .expect("compile");
        for c in cases.iter().filter(|c| c["model"] == model) {
            let messages: Vec<ChatMessage> =
                serde_json::from_value(c["messages"].clone()).expect("messages");
            let add_gen = c["add_generation_prompt"].as_bool().expect("bool");
            let got = tmpl.render(&messages, add_gen).expect("render");
            assert_eq!(
                got,
                c["expected"].as_str().expect("expected"),
                "{model} / {} / add_generation_prompt={add_gen}",
                c["conversation"]
            );
            checked += 1;
        }
    }
    assert_eq!(checked, cases.len());
}

#[test]
fn qwen_system_user_prompt_exact() {
    let info = tokenizer::from_gguf_path(&common::model_path("qwen2.5-coder-0.5b-instruct"))
        .expect("tokenizer");
    let out = kvcredit::chat::render(
        info.chat_template.as_deref().expect("template"),
        &[
            ChatMessage::system("You are a careful math tutor."),
            ChatMessage::user("What is 17 * 23? Answer with #### N."),
        ],
        true,
        info.bos_token.as_deref(),
        info.eos_token.as_deref(),
    )
    .expect("render");
    assert_eq!(
        out,
        "<|im_start|>system\nYou are a careful math tutor.<|im_end|>\n<|im_start|>user\n\
         What is 17 * 23? Answer with #### N.<|im_end|>\n<|im_start|>assistant\n"
    );
    // the rendered prompt tokenizes with its special tokens whole
    let ids = info.tokenizer.encode(out.as_str(), false).expect("encode");
    assert_eq!(ids.get_ids()[0], 151_644);
    assert_eq!(ids.get_ids().iter().filter(|&&i| i == 151_645).count(), 2);
}

#[test]
fn template_from_tokenizer_config_json() {
    let dir = std::env::temp_dir().join(format!("kvcredit-chat-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    let p = dir.join("tokenizer_config.json");
    std::fs::write(
        &p,
        r#"{"bos_token": {"content": "<s>"}, "eos_token": "</s>",
            "chat_template": [{"name": "tool_use", "template": "x"},
                              {"name": "default", "template": "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"}]}"#,
    )
    .expect("write");
    let t = ChatTemplate::from_tokenizer_config(&p).expect("config");
    assert_eq!(
        t.render(&[ChatMessage::user("hi")], false).expect("render"),
        "<s>[user] hi</s>"
    );
    std::fs::write(&p, r#"{"eos_token": "</s>"}"#).expect("write");
    let e = ChatTemplate::from_tokenizer_config(&p)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(e.contains("no `chat_template`"), "{e}");
}
