"""``GET /docs``: Swagger UI over the server's OpenAPI schema, from a pinned release with subresource integrity.

The page loads Swagger UI's script and stylesheet from jsDelivr (the server ships no copy of them) at one exact
release, each with its ``integrity`` hash: a changed or substituted file is refused by the browser rather than run on
this server's origin. ``scripts/pin-swagger-ui`` prints a new pin. ``--no-docs`` takes the page away (the schema at
``/openapi.json`` stays, for clients and tools).
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

SWAGGER_UI_VERSION = "5.35.0"
CDN = f"https://cdn.jsdelivr.net/npm/swagger-ui-dist@{SWAGGER_UI_VERSION}"
INTEGRITY = {
    "swagger-ui-bundle.js": "sha384-gjRm0bEPMeTmMh5jT2cHccIwCUZSTd8YC+j0d0sXw0MdGEfScduGpSyF3ZSSLkX9",
    "swagger-ui.css": "sha384-WlYgdmXYOOBWL5apwjDEZwN+U3HmXSSu5R6V5aGxEcf7z+KuRNwBhoxKVN1i3D5I",
}
"""What each file of :data:`SWAGGER_UI_VERSION` hashes to (``scripts/pin-swagger-ui``)."""

router = APIRouter()

_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>halfserve API</title>
<link rel="stylesheet" href="{cdn}/swagger-ui.css" integrity="{css}" crossorigin="anonymous">
</head>
<body>
<div id="swagger-ui"></div>
<script src="{cdn}/swagger-ui-bundle.js" integrity="{js}" crossorigin="anonymous"></script>
<script>
SwaggerUIBundle({{
  url: {schema}, dom_id: "#swagger-ui", layout: "BaseLayout", deepLinking: true,
  presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset],
}});
</script>
</body>
</html>
"""


@router.get("/docs", include_in_schema=False)
async def docs(request: Request) -> HTMLResponse:
    schema = json.dumps(request.scope.get("root_path", "") + "/openapi.json").replace("<", "\\u003c")
    page = _PAGE.format(cdn=CDN, css=INTEGRITY["swagger-ui.css"], js=INTEGRITY["swagger-ui-bundle.js"], schema=schema)
    return HTMLResponse(page, headers={"Referrer-Policy": "no-referrer"})
