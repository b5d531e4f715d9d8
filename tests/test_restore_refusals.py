"""What the overwriting types (clean_restore, freeze) refuse, each in one line naming the type
and the shapes: donor states of the wrong rank, rows without states or past the donors, unknown
settings, a forward with no donor, a donor whose positions or width do not fit the component.
A control in each: the same call with fitting inputs overwrites exactly the masked cells. The
calls are announced as our hooks announce theirs: a type with its own positions refuses a call
that is not (pyvene's own class, or a direct call)."""

from __future__ import annotations

import pytest
import torch

from pyvene_causaltrace.errors import InputError, PyveneModelError
from pyvene_causaltrace.interventions.restore import CleanRestore, Freeze
from pyvene_causaltrace.pyvene_boundary.calls import calling

BASE = torch.zeros(2, 5, 8)


def announced(made, *args):
    """``made(*args)`` with its call announced (to the whole value), as our hooks call it."""
    with calling(torch.nn.Identity(), (BASE,), None):
        return made(*args)


@pytest.mark.parametrize("kwargs,message", [
    ({"states": torch.ones(1, 2, 5, 8)},
     r"states must be \[rows, seq, hidden\], got \(1, 2, 5, 8\)"),
    ({"state_rows": [0]}, "state_rows needs states"),
    ({"states": torch.ones(2, 5, 8), "state_rows": [0, 2]}, "points past the 2 donor rows"),
    ({"states": torch.ones(5, 8), "colour": "red"}, "clean_restore got unexpected settings colour"),
])
def test_bad_settings_are_refused_when_made(kwargs, message):
    with pytest.raises(InputError, match=message):
        CleanRestore(positions=[1], **kwargs)


def test_a_donor_that_does_not_fit_the_component_is_refused():
    restore = CleanRestore(positions=[[1], [3]])
    with pytest.raises(InputError, match="clean_restore has no stored states and pyvene "
                                         "passed no source"):
        announced(restore, BASE)
    with pytest.raises(InputError, match=r"donor states are \(2, 4, 8\), the component output "
                                         r"is \(2, 5, 8\)"):
        announced(restore, BASE, torch.ones(2, 4, 8))
    with pytest.raises(InputError, match=r"freeze: donor states are \(2, 5, 6\)"):
        announced(Freeze(positions=[1]), BASE, torch.ones(2, 5, 6))
    # the control: row 0 at 1, row 1 at 3, nothing else
    out = announced(restore, BASE, torch.ones(2, 5, 8))
    assert out.sum() == 16 and out[0, 1].eq(1).all() and out[1, 3].eq(1).all()
    stored = CleanRestore(positions=[2], states=torch.full((5, 8), 3.0), state_rows=[0, 0])
    out = announced(stored, BASE)  # one donor row shared by both rows, through state_rows
    assert out[:, 2].eq(3).all() and out.sum() == 2 * 8 * 3
    with pytest.raises(PyveneModelError, match="clean_restore has its own positions"):
        stored(BASE)  # not announced: it could be a gathered or generated sequence
