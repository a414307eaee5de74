"""`--cuda-graphs`: on where CUDA is absent is a one-line error (exit 2) before anything loads."""

import pytest
import torch

from specdec.api.cli import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: --cuda-graphs on runs")
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cuda_graphs_on_without_cuda_is_refused(command, capsys):
    assert main([command, "--cuda-graphs", "on", *(["hello"] if command == "generate" else [])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("specdec: error: cuda_graphs 'on' needs a CUDA device; this engine runs on cpu "
                       "(--cuda-graphs auto is off there)")
