"""`residentd.Tls`: PEM given as bytes, as text or as a path, read at once;
what is missing or unreadable said by name; picklable (Ray carries it to
the actor). The handshakes themselves are checked against a real agent
(tests/fleet/tls_check.py)."""

import os
import pickle
import tempfile
import unittest
from pathlib import Path

from residentd import Tls

CA = b"-----BEGIN CERTIFICATE-----\nca\n-----END CERTIFICATE-----\n"
CERT = b"-----BEGIN CERTIFICATE-----\ncert\n-----END CERTIFICATE-----\n"
KEY = b"-----BEGIN PRIVATE KEY-----\nkey\n-----END PRIVATE KEY-----\n"


class TlsTest(unittest.TestCase):
    def test_pem_as_bytes_text_or_path(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "key.pem")
            with open(path, "wb") as f:
                f.write(KEY)
            for key in [KEY, KEY.decode(), path, Path(path)]:
                tls = Tls(CA, CERT, key)
                self.assertEqual((tls.ca, tls.cert, tls.key), (CA, CERT, KEY), key)

    def test_missing_or_unreadable_material_is_named(self):
        with self.assertRaisesRegex(ValueError, "Tls key /nonexistent/k.pem: No such file"):
            Tls(CA, CERT, "/nonexistent/k.pem")
        with self.assertRaisesRegex(ValueError, "Tls cert: missing"):
            Tls(CA, None, KEY)
        with self.assertRaisesRegex(TypeError, "Tls ca: PEM bytes or a path, not int"):
            Tls(3, CERT, KEY)

    def test_a_name_overrides_the_host_checked(self):
        self.assertEqual(Tls(CA, CERT, KEY).options(), [])
        self.assertEqual(Tls(CA, CERT, KEY, name="node-7").options(),
                         [("grpc.ssl_target_name_override", "node-7")])

    def test_it_pickles_as_bytes(self):
        tls = Tls(CA, CERT, KEY, name="n")
        self.assertEqual(pickle.loads(pickle.dumps(tls)), tls)


if __name__ == "__main__":
    unittest.main()
