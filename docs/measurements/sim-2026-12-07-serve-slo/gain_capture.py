import json,sys,statistics as st
for path in sys.argv[1:]:
    d=json.load(open(path))
    pols={}
    for e in d['entries']:
        pols.setdefault(e['policy'],[]).append(e)
    for p,es in pols.items():
        rs=[];fails=[];caps=[];caps_pass=[]
        for e in es:
            r=e['ratio'] if e['ratio'] is not None else 0.0
            if e['failed']: fails.append(e['scenario'])
            rs.append(r)
            o=e['oracle_tokens_per_joule'];df=e['default_tokens_per_joule']
            if o and df and o>=1.05*df:
                dr=df/o
                caps.append((r-dr)/(1-dr))
                if not e['failed']: caps_pass.append((r-dr)/(1-dr))
        med=lambda x: st.median(x) if x else float('nan')
        print(f"{path}: {p}: median {st.median(rs):.3f} failed {len(fails)}/{len(es)} capture {med(caps):.3f} (n={len(caps)}; failed as 0) capture-passing {med(caps_pass):.3f} (n={len(caps_pass)})")
