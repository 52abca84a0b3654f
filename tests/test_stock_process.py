"""transformers' methods in a worker process (`entmtp.stock_process`): the same tokens as in this
process, errors as one line, the worker gone after close."""

import pytest

from conftest import save_tiny_base
from entmtp import threads
from entmtp.methods import ModelOptions, Runner, get_method, hf_generate, load_engine_for
from entmtp.stock_process import StockProcess, StockProcessError


def test_the_worker_decodes_what_this_process_decodes(tmp_path):
    save_tiny_base(tmp_path / "base")
    opts = ModelOptions(model=str(tmp_path / "base"))
    engine = load_engine_for(opts, ["hf"], progress=None)
    prompts = [[5, 6, 7, 8], list(range(3, 30))]
    with StockProcess(opts) as stock:
        assert stock.info["pid"] == stock.proc.pid
        # its CPU is this process's to the thread governor: generate's run is no busy neighbour
        assert stock.proc.pid in threads._WORKERS
        for ids in prompts:
            here = hf_generate(engine, ids, 10)
            there = stock.decode("hf", ids, 10)
            assert there.tokens == here.tokens and there.forwards == here.forwards
            assert stock.decode("pld", ids, 10, pld_tokens=4).tokens == hf_generate(
                engine, ids, 10, prompt_lookup_num_tokens=4).tokens
        assert stock.fit_threads("hf", prompts[0], 6) >= 1
        # a Runner with the worker decodes there
        r = Runner(get_method("hf"), engine, 10, stock=stock)
        assert r(prompts[1]).tokens == hf_generate(engine, prompts[1], 10).tokens
        with pytest.raises(StockProcessError, match="^generate process: ") as e:
            stock.decode("warp", prompts[0], 4)
        assert len(str(e.value).splitlines()) == 1
        assert stock.decode("hf", prompts[0], 3).tokens == hf_generate(engine, prompts[0], 3).tokens  # still serving
    assert stock.proc.poll() is not None  # closed: the worker has ended
    assert stock.proc.pid not in threads._WORKERS


def test_a_model_the_worker_cannot_load_is_one_line(tmp_path):
    with pytest.raises(StockProcessError) as e:
        StockProcess(ModelOptions(model=str(tmp_path / "missing")))
    msg = str(e.value)
    assert msg.startswith("generate process: ") and len(msg.splitlines()) == 1
