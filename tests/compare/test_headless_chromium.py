"""The browser test's rule when no Chromium is found: skip with one reason on a user's machine, fail under CI."""

import headless_chromium
import pytest


@pytest.fixture
def no_browser(monkeypatch):
    monkeypatch.setattr(headless_chromium.shutil, "which", lambda name: None)


@pytest.mark.parametrize("ci", [None, "", "false", "0"])
def test_no_chromium_skips_outside_ci(no_browser, monkeypatch, ci):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.skip.Exception) as skipped:
        headless_chromium.require_chromium()
    assert str(skipped.value) == "chromium is not installed (optional: apt-get install -y chromium; .ci/run installs it)"


@pytest.mark.parametrize("ci", ["true", "True", "1"])
def test_no_chromium_fails_under_ci(no_browser, monkeypatch, ci):
    monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.fail.Exception, match=r"^chromium is not installed .*CI=true, so the browser test must run"):
        headless_chromium.require_chromium()


@pytest.mark.parametrize("ci", [None, "true"])
def test_a_found_chromium_is_returned(monkeypatch, ci):
    monkeypatch.setattr(headless_chromium.shutil, "which", lambda name: "/opt/x/chromium" if name == "chromium" else None)
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    assert headless_chromium.require_chromium() == "/opt/x/chromium"
