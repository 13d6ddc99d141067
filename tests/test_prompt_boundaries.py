"""Passage boundaries hold for every pre-tokenizer kvrag accepts, each with the break `choose_break` gives it: a
prompt built from its segments is token for token the whole prompt's, on the real tokenizers (SmolLM2's GPT-2-style
BPE, Qwen2.5's from its GGUF, Gemma 3's SentencePiece-style BPE) and on Llama 3's pre-tokenizer regex put over
Qwen2.5's vocabulary (which has the merges, such as ":ĊĊ", that make a boundary matter), for passages that end and
start in punctuation, digits, spaces, CJK, code and Windows line breaks. Qwen2.5-Coder-0.5B is pulled by `make test`
(and so by .ci/run) into the user's KVRAG_HOME."""

from __future__ import annotations

import json
import shutil

import pytest

from kvrag.errors import KvragError
from kvrag.model.prompt import BREAKS, PromptBuilder, check_segmentation, choose_break, encode
from kvrag.model.tokenizer import Tokenizer

# the pre-tokenizers' own patterns (their tokenizer.json files): Qwen2 splits digits one by one, Llama 3 by three
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_REGEX = QWEN2_REGEX.replace(r"|\p{N}|", r"|\p{N}{1,3}|")

ENDS = ["about rivers.", "in 1999", "trailing spaces   ", "東京は日本の首都です。", "def f(x):\n    return {x: 1}",
        "line one\r\nline two\r\n", "what?!", "a word", "(see note)", "ends in a quote”", "tab\t", "emoji 🙂",
        "x = [1, 2, 3];", "100%", "Dr.", "a--"]
STARTS = ["The river", "1999 was", "東京は", "(note)", "\"Quoted\"", "- item", "def g():", "’s", "42 lakes", "…and",
          "\r\nafter a break", "  indented", "#include <x>"]


def _regex_tokenizer(model, tmp_path, regex: str) -> Tokenizer:
    """A model's vocabulary and merges behind a pre-tokenizer regex, as Qwen2's and Llama 3's tokenizer.json write
    it: the regex split, then byte-level mapping without GPT-2's own regex."""
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        if (model.path / name).exists():
            shutil.copy(model.path / name, folder / name)
    spec = json.loads((model.path / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return Tokenizer(folder)


@pytest.fixture(scope="module")
def gemma_tokenizer(tmp_path_factory):
    """Gemma 3 270M's own tokenizer, read from its GGUF as the conversion reads it (about 20 s), in kvrag's loader."""
    from transformers import AutoTokenizer

    from kvrag.model.names import known_gguf

    gguf = known_gguf("gemma3-270m")
    folder = tmp_path_factory.mktemp("gemma-tokenizer")
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(folder))
    return Tokenizer(folder)


# the break each tokenizer gets: the paper's own where the pre-tokenizer splits before line breaks, else a space first
EXPECTED_BREAK = {"smollm2": "\n\n", "gemma3": "\n\n", "qwen2.5": " \n\n", "llama3-regex": " \n\n"}


@pytest.fixture(params=list(EXPECTED_BREAK))
def tokenizer(request, smol_tokenizer, tmp_path):
    name = request.param
    if name == "smollm2":
        tok = smol_tokenizer
    elif name == "qwen2.5":
        tok = request.getfixturevalue("qwen05").load_tokenizer()
    elif name == "llama3-regex":
        tok = _regex_tokenizer(request.getfixturevalue("qwen05"), tmp_path, LLAMA3_REGEX)
    else:
        tok = request.getfixturevalue("gemma_tokenizer")
    assert choose_break(tok) == EXPECTED_BREAK[name]
    return tok


def test_every_kind_of_passage_end_splits_at_the_break(tokenizer):
    """Any passage end before any passage start: the two segments' ids are the joined text's ids."""
    builder, parted = PromptBuilder(tokenizer), []
    for end in ENDS:
        before = builder.render_passage("", end)
        for start in STARTS:
            after = builder.render_passage("", start)
            if encode(tokenizer, before) + encode(tokenizer, after) != encode(tokenizer, before + after):
                parted.append((end, start))
    assert parted == []


def test_whole_prompts_from_segments(tokenizer, invented_items):
    """Real prompts of the chat template (or a base model's bare one): preamble, passages, suffix."""
    builder = PromptBuilder(tokenizer)
    check_segmentation(builder)
    for item in invented_items[:3]:
        texts = [builder.render_passage(c["title"], c["text"]) for c in item["ctxs"]]
        texts += [builder.render_passage("", e) for e in ENDS]
        segmented = builder.build([encode(tokenizer, t) for t in texts], item["question"]).flat()
        assert segmented == encode(tokenizer, builder.template.full_text(texts, item["question"]))


@pytest.mark.parametrize("regex", [None, LLAMA3_REGEX], ids=["qwen2.5", "llama3-regex"])
def test_the_papers_break_is_refused_in_one_line(qwen05, tmp_path, regex):
    """With the paper's bare "\\n\\n" (what kvrag used for every tokenizer before), Qwen2's and Llama 3's regex join
    "Passages:" and a passage's end with those line breaks. The refusal names the tokenizer, the boundary and the two
    id lists where they part."""
    tokenizer = qwen05.load_tokenizer() if regex is None else _regex_tokenizer(qwen05, tmp_path, regex)
    check_segmentation(PromptBuilder(tokenizer))  # its own break holds
    with pytest.raises(KvragError) as refused:
        check_segmentation(PromptBuilder(tokenizer, BREAKS[0]), "Qwen2.5's")
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("Qwen2.5's tokenizer (Qwen2Tokenizer) merges tokens across the passage boundary '\\n\\n'")
    segments, whole = message.split("segments give ")[1].split(", the whole prompt ")
    assert segments.split("]")[0] != whole.split("]")[0]


def test_the_regexes_are_qwens_and_llama_3s(qwen05):
    spec = json.loads((qwen05.path / "tokenizer.json").read_text())["pre_tokenizer"]
    assert spec["pretokenizers"][0]["pattern"]["Regex"] == QWEN2_REGEX
    assert LLAMA3_REGEX != QWEN2_REGEX  # Llama 3's differs in its digits only


def test_a_tokenizer_no_break_holds_for_is_refused_with_the_last():
    class Merging:  # ids depend on the whole text: every boundary merges
        chat_template = None

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [len(text)]}

    assert choose_break(Merging()) == BREAKS[-1]
    with pytest.raises(KvragError, match=r"\(Merging\) merges tokens across the passage boundary ' \\n\\n'"):
        check_segmentation(PromptBuilder(Merging()))
