open('/tmp/review_docs/cli/imported.flag','w').write('x')
def wire(): pass
