import pytest


pytest.importorskip("triton")
