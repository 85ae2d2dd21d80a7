import sys, blobfeed
net = blobfeed.Net(name="c")
try:
    with blobfeed.attach_source(net, ["data", "label"], 8, "train", sys.argv[1], connect_timeout=5, timeout=5):
        net.run()
except Exception as e: print("consumer:", type(e).__name__, str(e)[:300])
