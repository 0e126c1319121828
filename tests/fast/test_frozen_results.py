"""A plan is data the user saw: executing it answers a new result and leaves the plan as it was shown."""

from __future__ import annotations

from dataclasses import FrozenInstanceError

import pytest

from kvctl.core.admin.mp_admin import Change, StorageStatus
from kvctl.core.pins import pinsets
from tests.fast.test_pinsets import TWO, PinIdInstance, sample_stores, write_set


def test_applying_a_pin_set_leaves_its_plan_as_shown(tmp_path):
    instance = PinIdInstance("memory", sample_stores())
    application = pinsets.plan(pinsets.load(write_set(tmp_path, TWO)), instance)
    shown = application.as_dict()
    done = pinsets.execute(application, instance)
    assert application.as_dict() == shown and application.dry_run
    assert not done.dry_run and [step.chunks for step in done.steps] == [4, 3]
    with pytest.raises(FrozenInstanceError):
        application.dry_run = False
    with pytest.raises(FrozenInstanceError):
        done.steps[0].error = "changed"


def test_a_reconfiguration_cannot_be_changed_once_planned():
    change = Change("add", "l2", "/dev/dax0.0", "/path", {"device_path": "/dev/dax0.0"},
                    StorageStatus([], [], {}), None, True)
    with pytest.raises(FrozenInstanceError):
        change.dry_run = False
