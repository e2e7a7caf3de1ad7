"""Keys twinplane has removed: on the command line or in a config file, the error any unknown key gets, naming
what replaced them; in a run's saved config.yaml (which lists every key) dropped where they changed nothing."""

import pytest

from twinplane.config import REMOVED, ConfigError, load_config, without_removed


@pytest.mark.parametrize("key", sorted(REMOVED))
def test_a_removed_key_is_an_unknown_key_naming_its_replacement(key, tmp_path):
    hint, inert = REMOVED[key]
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{key}={str(inert).lower()}"])
    assert str(e.value) == f"unknown key {key} ({hint})"
    section, leaf = key.split(".")
    (tmp_path / "c.yaml").write_text(f"{section}:\n  {leaf}: {str(inert).lower()}\n")
    with pytest.raises(ConfigError, match=f"^unknown key {key} "):
        load_config(tmp_path / "c.yaml")  # a config file of the user's: as written, so as strict


def test_a_saved_config_drops_what_changed_nothing_and_refuses_what_changed_the_run(tmp_path):
    saved = {"seed": 0, "cluster": {"max_staleness": 0, "async": False}}
    assert without_removed(saved, "run/config.yaml") == {"seed": 0, "cluster": {"max_staleness": 0}}
    assert saved["cluster"]["async"] is False  # (the caller's dict is left as it is)
    with pytest.raises(ConfigError) as e:
        without_removed({"cluster": {"max_staleness": 0, "async": True}}, "run/config.yaml")
    assert str(e.value) == "run/config.yaml: unknown key cluster.async (did you mean cluster.max_staleness=1?)"
    (tmp_path / "config.yaml").write_text("cluster:\n  max_staleness: 2\n  async: false\n")
    assert load_config(tmp_path / "config.yaml", saved=True).cluster.max_staleness == 2
    (tmp_path / "config.yaml").write_text("cluster:\n  async: true\n")
    with pytest.raises(ConfigError, match=r"config.yaml: unknown key cluster.async \(did you mean "):
        load_config(tmp_path / "config.yaml", saved=True)
