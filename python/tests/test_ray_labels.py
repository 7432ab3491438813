"""The label encoding of agent endpoints (Ray's label syntax allows no
'/' or ':'). Needs ray importable; skipped, saying so, without it."""

import unittest

try:
    from residentd import ray as rray
except ImportError as e:  # ray is an optional dependency
    rray = None
    WHY = str(e)


@unittest.skipIf(rray is None, "ray is not installed")
class LabelTest(unittest.TestCase):
    def test_endpoints_round_trip_through_valid_label_values(self):
        for endpoint in ["/run/residentd/residentd.sock", "unix:/tmp/a.sock", "10.0.0.5:50051"]:
            value = rray.label_value(endpoint)
            self.assertRegex(value, r"^[a-z0-9]([a-z0-9._-]*[a-z0-9])?$")
            self.assertLessEqual(len(value), 63)
            self.assertEqual(rray.endpoint_of(value), endpoint)
        self.assertEqual(rray.labels("/x"), "residentd.io/agent=" + rray.label_value("/x"))

    def test_a_long_path_is_refused_with_a_hint(self):
        with self.assertRaisesRegex(ValueError, "HOST:PORT"):
            rray.label_value("/" + "d" * 60 + "/agent.sock")


if __name__ == "__main__":
    unittest.main()
