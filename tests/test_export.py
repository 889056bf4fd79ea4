"""gspo export: a checkpoint as a standard HF model directory (transformers loads it without gspo), LoRA adapters
as peft adapters or merged, and one line for every bad input."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from gspo.cli import main
from gspo.train import Trainer

from test_trainer import tiny_config, tiny_dir  # noqa: F401  (the module fixture)


@pytest.fixture(scope="module")
def trained(tiny_dir, tmp_path_factory):  # noqa: F811
    run = tmp_path_factory.mktemp("export") / "run"
    trainer = Trainer(tiny_config(tiny_dir), run)
    trainer.train()
    return run, {n: p.detach().clone() for n, p in trainer.actor.model.named_parameters()}


def test_a_run_exports_as_a_model_transformers_loads(trained, tmp_path):
    run, weights = trained
    assert main(["export", str(run), "--out", str(tmp_path / "bf16")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert next(model.parameters()).dtype == torch.bfloat16
    for name, p in model.named_parameters():
        assert torch.equal(p, weights[name].to(torch.bfloat16)), name
    tok = AutoTokenizer.from_pretrained(tmp_path / "bf16")
    assert tok.chat_template and "<|im_end|>" in tok.chat_template
    eos = GenerationConfig.from_pretrained(tmp_path / "bf16").eos_token_id
    assert tok.convert_tokens_to_ids("<|im_end|>") in (eos if isinstance(eos, list) else [eos])
    assert main(["export", str(run / "checkpoints" / "step-000002"), "--out", str(tmp_path / "fp32"),
                 "--dtype", "fp32"]) == 0
    exact = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32")
    assert all(torch.equal(p, weights[n]) for n, p in exact.named_parameters())
    assert not (tmp_path / "fp32.tmp").exists()


def test_a_lora_checkpoint_exports_as_its_adapter_or_merged(tiny_dir, tmp_path):  # noqa: F811
    peft = pytest.importorskip("peft")
    trainer = Trainer(tiny_config(tiny_dir, "lora.rank=4", "train.lr=1e-2"), tmp_path / "run")
    trainer.train()
    ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
    with torch.no_grad():
        expected = trainer.actor.model(ids).logits
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "adapter"), "--dtype", "fp32"]) == 0
    adapted = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_dir), tmp_path / "adapter")
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "merged"), "--dtype", "fp32",
                 "--merge-lora"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids).logits, expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(merged(ids).logits, expected, rtol=0, atol=1e-5)


def test_bad_export_inputs_are_one_line(trained, tmp_path, capsys):
    run, _ = trained
    (tmp_path / "taken").mkdir()
    (tmp_path / "empty").mkdir()
    (tmp_path / "w.tmp").mkdir()  # a directory of the user's that the export's temporary name would take
    cases = [
        (["export", str(run), "--out", str(tmp_path / "taken")], "exists; name a new directory"),
        (["export", str(tmp_path / "nope"), "--out", str(tmp_path / "x")], "is not a directory"),
        (["export", str(tmp_path / "empty"), "--out", str(tmp_path / "y")], "neither a complete checkpoint"),
        (["export", str(run), "--out", str(tmp_path / "z"), "--dtype", "int8"], "invalid choice"),
        (["export", str(run), "--out", str(tmp_path / "w")], "w.tmp' exists"),
    ]
    for argv, match in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert match in err and len(err.splitlines()) == 1 and err.startswith("gspo"), err
    assert not (tmp_path / "y").exists() and not (tmp_path / "y.tmp").exists()


@pytest.mark.parametrize("dtype, atol", [("fp32", 1e-4), ("bf16", 0.15)])
def test_gguf_export_reads_back_through_transformers(trained, tmp_path, dtype, atol):
    """--gguf writes model.gguf beside the HF files; transformers' GGUF reader (which undoes llama.cpp's Q/K row order)
    gives back the same logits, and its tokenizer encodes as the original does."""
    run, weights = trained
    out = tmp_path / "out"
    assert main(["export", str(run), "--out", str(out), "--dtype", dtype, "--gguf"]) == 0
    back = AutoModelForCausalLM.from_pretrained(out, gguf_file="model.gguf", dtype=torch.float32)
    plain = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 13, 2, 7, 300, 4000]])
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, plain(ids).logits, rtol=0, atol=atol)
    if dtype != "fp32":
        return  # the tokenizer is the same in both files; reading it back costs ~10 s (a 49k-entry GGUF vocabulary)
    text = "What is 7 + 5? Answer: 12 ... café"
    tok = AutoTokenizer.from_pretrained(out, gguf_file="model.gguf")
    assert tok(text)["input_ids"] == AutoTokenizer.from_pretrained(out)(text)["input_ids"]


def test_gguf_of_an_unmerged_adapter_is_refused(tiny_dir, tmp_path):  # noqa: F811
    pytest.importorskip("peft")
    trainer = Trainer(tiny_config(tiny_dir, "lora.rank=4"), tmp_path / "run")
    trainer.train()
    from gspo.errors import UserError
    from gspo.commands.export import export

    with pytest.raises(UserError, match="add --merge-lora"):
        export(tmp_path / "run", tmp_path / "out", gguf=True)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()
