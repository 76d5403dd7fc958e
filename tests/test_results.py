"""foscar.results: the JSON of results files."""

import json

import torch

from foscar.results import results_json, shortest_float32


def test_results_json_reads_back_and_keeps_number_lists_on_one_line():
    obj = {
        "rows": [{"nll": {"64": [1.5, -2.25e-05, 3, 0.0]}, "format": "INT4 [gluon]"}],
        "answer": [12, 7, 0],
        "names": ["a", "b"],
        "mixed": [1, "x", 2.5],
        "nested": [[1, 2], [3.5, 4]],
        "empty": [],
        "none": None,
        "text": 'x = [1,2], y = [ 3 ], "q" [4, 5]',
        'quoted " [6,7]': [8, 9],
    }
    text = results_json(obj)
    assert json.loads(text) == obj and text.endswith("}\n")
    lines = text.splitlines()
    assert '    "64": [1.5, -2.25e-05, 3, 0.0]' in lines
    assert ' "answer": [12, 7, 0],' in lines
    assert ' "names": [' in lines  # strings keep a line each
    assert '  [1, 2],' in lines and '  [3.5, 4]' in lines
    # text in strings is never touched, whatever brackets and numbers it holds
    assert ' "text": "x = [1,2], y = [ 3 ], \\"q\\" [4, 5]",' in lines
    assert ' "quoted \\" [6,7]": [8, 9]' in text
    assert ' "mixed": [' in lines  # a list not all numbers is left as it is
    assert len(results_json({"x": list(range(1000))}).splitlines()) == 3


def test_results_json_writes_float32_values_in_their_shortest_digits():
    nll = torch.tensor([0.7064415812492371, 0.1, 5.180774688720703, 1e-40]).tolist()  # float32
    measured = [0.1, 1 / 3, 12.667680621637347]  # float64 values keep every digit
    text = results_json({"nll": nll, "ms": measured})
    back = json.loads(text)
    assert torch.equal(torch.tensor(back["nll"]), torch.tensor(nll))  # the same float32 values
    assert back["ms"] == measured
    assert '"nll": [0.7064416, 0.1, 5.1807747, 1e-40]' in text
    assert shortest_float32(float("nan")) != shortest_float32(float("nan"))
    assert shortest_float32(float("inf")) == float("inf")
