"""The planted bugs of scripts/plant_bugs.py are current: every plant still applies to today's code (its text
occurs exactly once), the record of the last run (results/cpu/plant_bugs.json) holds every plant of the
list and caught each, and the README's and the GUIDE's counts are that record's."""

import json
import re
import sys

from common.paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import plant_bugs  # noqa: E402

RECORD = REPO_ROOT / "results" / "cpu" / "plant_bugs.json"


def test_every_plant_applies_to_todays_code():
    stale = [f"{name}: its text occurs {(REPO_ROOT / m[0]).read_text().count(m[1])} times in {m[0]}"
             for name, m in plant_bugs.MUTATIONS.items() if (REPO_ROOT / m[0]).read_text().count(m[1]) != 1]
    assert not stale, "plants that no longer apply (mend their text):\n" + "\n".join(stale)


def test_the_record_is_of_todays_list_and_caught_every_plant():
    rows = json.loads(RECORD.read_text())["rows"]
    assert [r["mutation"] for r in rows] == list(plant_bugs.MUTATIONS), \
        "the plant list changed since the last run: python scripts/plant_bugs.py --out results/cpu/plant_bugs.json"
    assert all(r["caught"] is True for r in rows), [r for r in rows if r["caught"] is not True]


def test_the_docs_quote_the_record():
    rows = json.loads(RECORD.read_text())["rows"]
    caught = sum(r["caught"] is True for r in rows)
    readme = (REPO_ROOT / "README.md").read_text()
    m = re.search(r"`python scripts/plant_bugs.py`: (\d+) of (\d+) caught at the last run", readme)
    assert m and (int(m.group(1)), int(m.group(2))) == (caught, len(rows)), m and m.group(0)
    guide = (REPO_ROOT / "docs" / "GUIDE.md").read_text()
    m = re.search(r"`python scripts/plant_bugs.py` plants (\d+) bugs", guide)
    assert m and int(m.group(1)) == len(rows), m and m.group(0)
