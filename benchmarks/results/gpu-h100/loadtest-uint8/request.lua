
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/octet-stream"
wrk.headers["Inference-Header-Content-Length"] = "167"
local f = io.open(os.getenv("HALFSERVE_BODY"), "rb")
wrk.body = f:read("*a")
f:close()
