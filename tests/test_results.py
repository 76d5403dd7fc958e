"""foscar.results: the JSON of results files."""

import json

from foscar.results import results_json


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
